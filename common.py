"""What the four scripts share: first the task, the part to replace for your own model and
data (docs/your-own-task.md; MNIST is the default), then the few helpers the scripts share. The
machinery is in ddpkit/, a module per concern (docs/maintainers.md): the lesson never opens it."""
import collections
import itertools
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose (the lesson's and the scripts' processes
# import this file first): it binds `group.WORLD` as a default argument. DDP's constructor and
# torchvision import it; imported after init_process_group, it pins the live group, which
# destroy_process_group then cannot free, and gloo's threads run on into interpreter shutdown,
# where they can abort the process (exit -6). tests/test_shutdown.py.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset, default_collate


class Fatal(Exception):
    """A problem with the user's input or data: one line, exit code 2 (launch.clean_exit)."""
    code, says = 2, "error"


def reason(e, line=0):
    """An exception in a few words, as Python names it: its type, and a line of its message if it
    has one (the first; -1: the last)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[line][:300]}" if lines else type(e).__name__


def say(line):
    """`line` and its newline on stderr in one write, so that the lines of processes sharing a
    pipe (every rank's stderr under a launcher) stay whole."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor
        print(line, file=sys.stderr, flush=True)


# ---- 1. The task: MNIST. Replace these names, in place, by defining them again at the end of
# this file, or in a file of your own given by --task (docs/your-own-task.md). ------------------

def add_task_flags(parser):
    """The task's own flags; it may also change the defaults of the others (set_defaults)."""
    parser.add_argument("--data-dir", default="./data", help="MNIST root (torchvision layout); "
                        "downloaded there once if missing (default: ./data)")
    parser.add_argument("--dummy", action="store_true", help="synthetic data with MNIST's "
                        "shapes, no files needed")
    parser.set_defaults(channels_last=True)  # a convolutional network: NHWC is faster


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def prepare_data(args):
    """Download MNIST if missing, and read it once, so that a missing or malformed file is one
    line here, not one per process; called once per machine before any process reads the data.
    Optional: a task whose make_datasets is not MNIST's has nothing prepared here."""
    if make_datasets is not mnist_datasets or args.dummy:
        return
    from torchvision.datasets import MNIST  # not at the top: ~1 s for a process without MNIST
    raw = os.path.join(args.data_dir, "MNIST", "raw")
    files = [os.path.splitext(name)[0] for name, _ in MNIST.resources]  # without .gz
    if not all(os.path.exists(os.path.join(raw, f)) for f in files):
        try:  # into a private folder, then moved in: machines sharing a disk never collide
            os.makedirs(raw, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".download-", dir=args.data_dir) as tmp:
                MNIST(tmp, download=True)
                for f in files:
                    os.replace(os.path.join(tmp, "MNIST", "raw", f), os.path.join(raw, f))
        except Exception as e:
            raise Fatal(f"MNIST is not in {raw} (needs {', '.join(files)}) and could not be "
                        f"downloaded ({reason(e, -1)}); copy the files there, or use --dummy") \
                from None
    read_mnist(args.data_dir)  # once: a malformed file is said here


def make_datasets(args):
    """(training set, test set): map-style datasets. Random augmentation draws from torch's global
    RNG, as torchvision's transforms do (data.PerSampleSeeds seeds it per sample)."""
    if args.dummy:  # noisy copies of ten random templates, the same in every process
        g = torch.Generator().manual_seed(1234)
        templates = torch.rand(10, 28, 28, generator=g) * 255
        y = torch.randint(0, 10, (70000,), generator=g)
        x = (templates[y] + torch.randn(70000, 28, 28, generator=g) * 60).clamp(0, 255)
        return InMemoryMNIST(x[:60000], y[:60000]), InMemoryMNIST(x[60000:], y[60000:])
    return tuple(InMemoryMNIST(x, y) for x, y in read_mnist(args.data_dir))


def read_mnist(root):
    """MNIST's (images, labels) for training and for testing, as torchvision reads them (its
    .data and .targets), checked: a malformed file is one line."""
    from torchvision.datasets import MNIST
    pairs = []
    for split in ("train", "t10k"):
        files = os.path.join(root, "MNIST", "raw", f"{split}-*-ubyte")
        try:
            mnist = MNIST(root, train=split == "train")
        except Exception as e:  # torchvision's own checks: bare asserts, a tensor's view
            raise Fatal(f"{files}: not MNIST files, as torchvision reads them ({reason(e)})") \
                from None
        x, y = mnist.data, mnist.targets
        if len(x) != len(y):
            raise Fatal(f"{files}: {len(x)} images but {len(y)} labels")
        if x.shape[1:] != (28, 28) or (len(y) and y.max() > 9):
            raise Fatal(f"{files}: {x.shape[1]}x{x.shape[2]} images, labels up to {y.max()}; "
                        "MNIST's are 28x28, 0-9")
        pairs.append((x, y))
    return pairs


mnist_datasets = make_datasets  # what prepare_data prepares for


def collate(samples):
    """A batch as (inputs, target), inputs a tensor or a tuple or dict of tensors: torch's
    default_collate of the samples, or a whole batch from __getitems__ (MNIST's) as it is."""
    return samples if isinstance(samples, tuple) else default_collate(samples)


def make_model(args):
    return Net()


def loss_fn(output, target):
    return F.cross_entropy(output, target, label_smoothing=0.1)  # smoothing: tuned for MNIST


def evaluate_batch(output, target):
    """One test batch's sums, added up over the test set and over all processes (`evaluate`)."""
    return {"correct": (output.argmax(1) == target).sum(), "total": torch.tensor(len(target))}


def summarize(sums):
    """The metrics from the sums over the test set: printed, in --metrics, read by bench.py."""
    return {"test_acc": 100.0 * sums["correct"] / sums["total"], "correct": int(sums["correct"]),
            "total": int(sums["total"])}


# The optimizer recipe: Adam with betas tuned for MNIST (tuomaso/train_mnist_fast), a linear
# warmup and decay per step, and the LR scaled with the global batch.
BETAS = (0.7, 0.9)
REFERENCE_BATCH = 256  # --lr is the learning rate at this global batch
LR_RULES = {"sqrt": "square-root rule, for Adam", "linear": "linear rule, for SGD",
            "none": "not scaled"}
# Adam's second-moment estimate is unreliable before about 1 / (1 - beta2) steps: warm up over
# at least twice that (Ma & Yarats 2019), however few steps an epoch has.
MIN_WARMUP_STEPS = round(2 / (1 - BETAS[1]))  # 20


def make_optimizer(model, args):
    return torch.optim.Adam(model.parameters(), lr=peak_lr(args), betas=BETAS)


def make_scheduler(optimizer, args, steps_per_epoch):
    """Per-step linear warmup from ~0 to the peak LR over --warmup-epochs (at least
    MIN_WARMUP_STEPS steps), then linear decay to 0 at --epochs."""
    total = max(1, args.epochs * steps_per_epoch)
    warmup = round(max(args.warmup_epochs * steps_per_epoch, MIN_WARMUP_STEPS))
    warmup = max(1, min(total - 1, warmup))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))  # a run of one step: 0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_lr(args):
    """--lr is the LR at a global batch of 256; a batch k times larger gets sqrt(k) times the LR
    with Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms"), or k times with SGD (Goyal et al. 2017, the linear rule). docs/training.md."""
    k = args.batch_size / REFERENCE_BATCH
    return args.lr * {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[args.lr_scaling]


def fsdp_units(model):
    """torchrun_fsdp.py's units, each sharded on its own before the whole model: here each child
    of the model that holds weights (docs/fsdp.md)."""
    return [m for m in model.children() if any(True for _ in m.parameters())]


class Net(nn.Module):
    """Two conv blocks with BatchNorm (so --sync-bn means something) and a small head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


class InMemoryMNIST(TensorDataset):
    """MNIST as normalised tensors in memory. DataLoader asks `__getitems__` for a whole batch
    at once, which here is one indexing operation: no per-image Python work."""

    def __init__(self, images, labels):
        super().__init__(((images.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1),
                         labels.long())
        self.images, self.labels = self.tensors

    def __getitems__(self, indices):
        return self[torch.as_tensor(indices)]


# ---- 2. The helpers the scripts share ------------------------------------------------------------

def map_tensors(fn, inputs):
    """fn of every tensor of a batch's inputs (a tensor, or a dict, tuple, named tuple or list
    of them), in the inputs' structure: to_device's and --accumulate's (data.micro_batches)."""
    if isinstance(inputs, dict):
        return {k: map_tensors(fn, v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):  # a named tuple is built from its fields
        items = [map_tensors(fn, v) for v in inputs]
        return type(inputs)(*items) if hasattr(inputs, "_fields") else type(inputs)(items)
    return fn(inputs)


def to_device(inputs, device, channels_last=False):
    def move(t):  # with channels_last, a 4-D tensor (a batch of images) in that format too
        layout = torch.channels_last if channels_last and t.dim() == 4 else torch.preserve_format
        return t.to(device, non_blocking=True, memory_format=layout)
    return map_tensors(move, inputs)


def forward(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


# Torch before 2.8 can deadlock in destroy_process_group when a gloo thread frees the tensor of
# a recent collective (pytorch/pytorch#154976, seen on 2.4): the last ones stay referenced here.
recent = collections.deque(maxlen=64)


def reduce_tensor(t):
    """Mean of `t` over all processes (a copy); `t` itself when there is no process group.
    SUM, then divide: gloo has no ReduceOp.AVG in torch 2.4 and 2.5."""
    if not dist.is_initialized():
        return t
    t = t.clone()
    recent.append(t)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


def gather(row, device):
    """Every process's `row` of numbers, by rank: one all-gather (a tensor: nothing unpickled)."""
    mine = torch.tensor(row, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    recent.extend([mine, *everyone])
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).tolist()


@torch.no_grad()
def evaluate(model, loader, device, task=None, batches=None):
    """The task's metrics (`task`: the scripts' load_task; default: this file's) over the
    test set, or its first `batches` batches, each sample counted once: evaluate_batch's sums
    over this process's shard (the scripts give it every world_size-th sample, unpadded), then
    over all processes. Pass the plain model: a DDP wrapper's forward may sync buffers."""
    task = task or sys.modules[__name__]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if len(loader.dataset) < world_size:
        raise Fatal(f"the test set has {len(loader.dataset)} samples, fewer than the "
                    f"{world_size} processes: each must evaluate at least one")
    if dist.is_initialized():  # BatchNorm's statistics drift apart in training (each process
        for b in model.buffers():  # updates them with its own batches): rank 0's, the saved ones
            dist.broadcast(b, src=0)
    model.eval()
    sums = {}
    for inputs, target in itertools.islice(loader, batches):
        output = forward(model, to_device(inputs, device))
        batch_sums = task.evaluate_batch(output, target.to(device, non_blocking=True))
        for name, value in batch_sums.items():
            sums[name] = sums.get(name, 0) + torch.as_tensor(value, device=device).double()
    # A sharded model's forward is a collective (torchrun_fsdp.py): every process runs as many
    # as rank 0, whose shard is the longest, the extra ones on its last batch, not counted.
    most = math.ceil(math.ceil(len(loader.dataset) / world_size) / loader.batch_size) \
        if loader.batch_size else len(loader)
    limit = batches or math.inf
    for _ in range(min(most, limit) - min(len(loader), limit)):
        forward(model, to_device(inputs, device))
    names = sorted(sums)  # the same order in every process
    totals = torch.stack([sums[n] for n in names])
    recent.append(totals)
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return task.summarize(dict(zip(names, totals.tolist())))
