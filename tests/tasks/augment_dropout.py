# A task for tests/test_data_loading.py, appended to a copy of common.py the way
# docs/your-own-task.md says: MNIST with a random shift drawn from torch's global RNG (as
# torchvision's transforms draw), a brightness from NumPy's (as albumentations draws) and a
# model with dropout. With DDP_TEST_TASK_LOG=DIR, every sample's draw and every dropout mask
# are logged there, one JSON-lines file per process.
import hashlib  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from torch.utils.data import Dataset  # noqa: E402

_mnist_datasets = make_datasets  # noqa: F821 (this file is appended to common.py)


def _log(kind, **row):
    folder = os.environ.get("DDP_TEST_TASK_LOG")
    # Training only: the test batch evaluated before training (under no_grad) runs the model
    # once more; test_the_check_leaves_no_trace covers it.
    if folder and torch.is_grad_enabled():
        parent = torch.multiprocessing.parent_process()  # a data worker's: its training process
        row.update(rank=dist.get_rank() if dist.is_initialized() else None, pid=os.getpid(),
                   parent=parent and parent.pid)  # a data worker has no group: its parent's rank
        with open(os.path.join(folder, f"{kind}-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


class RandomShift(Dataset):
    """Shifts each image by up to 2 pixels in each direction, drawn per sample from torch's
    RNG, and adds a brightness drawn from NumPy's global RNG (as albumentations draws)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        x, y = self.data[index]
        dx, dy = torch.randint(-2, 3, (2,)).tolist()
        bright = float(np.random.uniform(-0.1, 0.1))
        _log("draws", index=int(index), seed=torch.initial_seed(), draw=[dx, dy, bright])
        return torch.roll(x, (dy, dx), dims=(1, 2)) + bright, y


class LoggedDropout(nn.Dropout):
    def forward(self, x):
        out = super().forward(x)
        if self.training:
            mask = (out != 0).cpu().numpy().tobytes()
            _log("dropout", seed=torch.initial_seed(), rows=len(x),
                 mask=hashlib.blake2b(mask, digest_size=8).hexdigest())
        return out


def make_datasets(args):
    train, test = _mnist_datasets(args)
    return RandomShift(train), test


def make_model(args):
    model = Net()  # noqa: F821
    model.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), LoggedDropout(0.25),
                               nn.Linear(128, 10))
    return model
