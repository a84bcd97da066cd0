"""What the four scripts share: first the task, the part to replace for your own model and
data (docs/your-own-task.md; MNIST is the default), then the few helpers the scripts share. The
machinery (command line and checks, SIGTERM, resuming, data workers) is in harness.py and
resumable.py, which the lesson never needs to open."""
import collections
import math
import os
import secrets
import struct
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate


class Fatal(Exception):
    """A problem with the user's input or data: one line, exit code 2 (harness.clean_exit)."""
    code = 2


# ---- 1. The task: MNIST. Replace these names, in place or by defining them again at the end
# of this file; the scripts reach the task only through them (docs/your-own-task.md). ------------

def add_task_flags(parser):
    """The task's own flags; it may also change the defaults of the others (set_defaults)."""
    parser.add_argument("--data-dir", default="./data", help="MNIST root (torchvision layout); "
                        "downloaded there once if missing (default: ./data)")
    parser.add_argument("--dummy", action="store_true", help="synthetic data with MNIST's "
                        "shapes, no files needed")
    parser.set_defaults(channels_last=True)  # a convolutional network: NHWC is faster


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def prepare_data(args):
    """Download MNIST if missing, and check its files; called once per machine before any process
    reads them. Optional: a task whose make_datasets is not MNIST's has nothing prepared here."""
    if make_datasets is not mnist_datasets or args.dummy:
        return
    raw = os.path.join(args.data_dir, "MNIST", "raw")
    if not all(os.path.exists(os.path.join(raw, f)) for f in MNIST_FILES):
        from torchvision.datasets import MNIST
        try:  # into a private folder, then moved in: machines sharing a disk never collide
            os.makedirs(raw, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".download-", dir=args.data_dir) as tmp:
                MNIST(tmp, train=True, download=True)
                for f in MNIST_FILES:
                    os.replace(os.path.join(tmp, "MNIST", "raw", f), os.path.join(raw, f))
        except Exception as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise Fatal(f"MNIST is not in {raw} (needs {', '.join(MNIST_FILES)}) and could not "
                        f"be downloaded ({reason}); copy the files there, or use --dummy") from None
    for split in ("train", "t10k"):  # what torchvision would fail on with a bare AssertionError
        images = read_idx(os.path.join(raw, f"{split}-images-idx3-ubyte"))
        labels = read_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte"))
        if labels.numel() and labels.max() > 9:
            raise Fatal(f"{raw}/{split}-labels-idx1-ubyte holds labels up to {labels.max()}; "
                        "MNIST's are 0-9")
        if len(images) != len(labels):
            raise Fatal(f"{raw}/{split}-*: {len(images)} images but {len(labels)} labels")


def make_datasets(args):
    """(training set, test set): map-style datasets. Random augmentation draws from torch's global
    RNG, as torchvision's transforms do (resumable.PerSampleSeeds seeds it per sample)."""
    if args.dummy:  # noisy copies of ten random templates, the same in every process
        g = torch.Generator().manual_seed(1234)
        templates = torch.rand(10, 28, 28, generator=g) * 255
        y = torch.randint(0, 10, (70000,), generator=g)
        x = (templates[y] + torch.randn(70000, 28, 28, generator=g) * 60).clamp(0, 255)
        return InMemoryMNIST(x[:60000], y[:60000]), InMemoryMNIST(x[60000:], y[60000:])
    raw = os.path.join(args.data_dir, "MNIST", "raw")  # checked by prepare_data
    return tuple(InMemoryMNIST(read_idx(os.path.join(raw, f"{split}-images-idx3-ubyte")),
                               read_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte")))
                 for split in ("train", "t10k"))


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
        return max(0.0, (total - step) / (total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_lr(args):
    """--lr is the LR at a global batch of 256; a batch k times larger gets sqrt(k) times the LR
    with Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms"), or k times with SGD (Goyal et al. 2017, the linear rule). docs/training.md."""
    k = args.batch_size / REFERENCE_BATCH
    return args.lr * {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[args.lr_scaling]


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


class InMemoryMNIST(Dataset):
    """MNIST as normalised tensors in memory. DataLoader asks `__getitems__` for a whole batch
    at once, which here is one indexing operation: no per-image Python work."""

    def __init__(self, images, labels):
        self.images = ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)
        self.labels = labels.long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]


def read_idx(path):
    """An uncompressed IDX file (MNIST's format: magic 0x00000803 for images, 0x00000801 for
    labels, then the sizes) as a uint8 tensor; a malformed file is one line."""
    ndim, kind = (3, "image") if "images" in os.path.basename(path) else (1, "label")
    with open(path, "rb") as f:
        header = f.read(4 + 4 * ndim)
        if len(header) < 4 + 4 * ndim or header[:4] != bytes([0, 0, 8, ndim]):
            raise Fatal(f"{path} is not an MNIST {kind} file: it starts with "
                        f"0x{header[:4].hex() or '(nothing)'}, not 0x0000080{ndim}")
        dims = struct.unpack(f">{ndim}I", header[4:])
        if ndim == 3 and dims[1:] != (28, 28):
            raise Fatal(f"{path} holds {dims[1]}x{dims[2]} images; MNIST's are 28x28")
        size, expected = os.fstat(f.fileno()).st_size, len(header) + math.prod(dims)
        if size != expected:
            raise Fatal(f"{path} is {'truncated' if size < expected else 'too long'}: "
                        f"{size} bytes, its header says {expected}")
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).view(*dims)


# ---- 2. The helpers the scripts share (the lesson takes save_checkpoint, and runs the rest) ---

def to_device(inputs, device, channels_last=False):
    """A batch's inputs (a tensor, or a tuple, list or dict of tensors) on the device; with
    channels_last, each 4-D tensor (a batch of images) in that memory format too."""
    if isinstance(inputs, dict):
        return {k: to_device(v, device, channels_last) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(to_device(v, device, channels_last) for v in inputs)
    layout = torch.channels_last if channels_last and inputs.dim() == 4 else torch.preserve_format
    return inputs.to(device, non_blocking=True, memory_format=layout)


def forward(model, inputs):
    """model(**inputs) for a dict, model(*inputs) for a tuple or list, model(inputs) otherwise."""
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


@torch.no_grad()
def evaluate(model, loader, device):
    """The task's metrics over the test set, each sample counted once: evaluate_batch's sums over
    this process's shard (the scripts give it every world_size-th sample, unpadded), then over
    all processes. Pass the plain model: a DDP wrapper's forward may sync buffers."""
    if dist.is_initialized():  # BatchNorm's statistics drift apart in training (each process
        for b in model.buffers():  # updates them with its own batches): rank 0's, the saved ones
            dist.broadcast(b, src=0)
    model.eval()
    sums = {}
    for inputs, target in loader:
        output = forward(model, to_device(inputs, device))
        for name, value in evaluate_batch(output, target.to(device, non_blocking=True)).items():
            sums[name] = sums.get(name, 0) + torch.as_tensor(value, device=device).double()
    names = sorted(sums)  # the same order in every process
    totals = torch.stack([sums[n] for n in names])
    recent.append(totals)
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return summarize(dict(zip(names, totals.tolist())))


def checkpoint_state(model, optimizer, scheduler, scaler, epoch, step, args):
    """Plain tensors and values only. `epoch` epochs done, plus `step` steps of the next one."""
    return {"model": model.state_dict(),  # the plain model: no "module." prefix
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "args": vars(args)}


def save_checkpoint(state, path):
    """A temporary file of this writer's own in the same folder, on the disk, renamed over `path`:
    a crash, a kill or a full disk leaves the previous checkpoint whole; writers never collide."""
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            torch.save(state, f)  # a file, not a path: a failed write raises OSError with its cause
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = e  # a failed write inside torch.save surfaces as the zip writer's RuntimeError
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if os.path.exists(tmp):
            os.remove(tmp)
        if cause is None:
            raise
        raise Fatal(f"could not write the checkpoint {path} ({cause.strerror or cause}); the "
                    "previous one, if any, is intact") from None


def load_checkpoint(path):
    """The checkpoint's tensors on the CPU, mapped from the file, not copied (processes on one
    machine share its pages); weights_only, as unpickling arbitrary objects could run code."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise Fatal(f"no checkpoint at {path}") from None
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Fatal(f"checkpoint {path} is corrupt or truncated ({reason[:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise Fatal(f"{path} is not a checkpoint of these scripts (no 'model' entry)")
    return ckpt
