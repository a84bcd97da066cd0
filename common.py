"""What the four scripts share, in the order a reader needs it:

1. The task: the model, the datasets, the loss and the optimizer recipe. This is the part to
   replace for your own task (docs/your-own-task.md); MNIST is the default.
2. What a learner reads next: metrics reduced over processes, exact evaluation, checkpoints and
   the resume decision that every process takes together.
3. The machinery: the command line and its checks, errors, the machine, data loading, the
   SIGTERM stop agreement and reporting.

How processes start and find each other lives in the scripts, never here."""
import argparse
import collections
import contextlib
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: this module binds `group.WORLD` as a
# default argument when it is first imported. DDP's constructor imports it (through
# torch._dynamo); imported then, it pins the live group, so destroy_process_group cannot free
# it and gloo's threads run on into interpreter shutdown, where they can abort the process
# ("terminate called without an active exception", exit code -6). tests/test_shutdown.py.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate


# =============================================================================================
# 1. The task: MNIST. Replace these names, in place or by defining them again at the end of
#    this file; everything else reaches the task only through them (docs/your-own-task.md).
# =============================================================================================

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def add_task_flags(parser):
    """The task's own flags; it may also change the defaults of the others (set_defaults)."""
    parser.add_argument("--data-dir", default="./data", help="MNIST root (torchvision layout); "
                        "downloaded there once if missing (default: ./data)")
    parser.add_argument("--dummy", action="store_true", help="synthetic data with MNIST's "
                        "shapes, no files needed")


def prepare_data(args):
    """Download MNIST if missing, then check its four files. Called once per machine before
    any process reads them: several processes downloading into one folder corrupt it. Each
    download goes to a private folder first and its files are moved in with os.replace, so two
    machines sharing a disk are safe too."""
    if args.dummy:
        return
    raw = os.path.join(args.data_dir, "MNIST", "raw")
    if not all(os.path.exists(os.path.join(raw, f)) for f in MNIST_FILES):
        from torchvision.datasets import MNIST
        tmp = None
        try:
            os.makedirs(raw, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".download-", dir=args.data_dir)
            MNIST(tmp, train=True, download=True)
            for f in MNIST_FILES:
                os.replace(os.path.join(tmp, "MNIST", "raw", f), os.path.join(raw, f))
        except Exception as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise Fatal(f"MNIST is not in {raw} (needs {', '.join(MNIST_FILES)}) and could not "
                        f"be downloaded ({reason}); copy the files there, or use --dummy") from None
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
    check_mnist(raw)


def make_datasets(args):
    """(training set, test set): map-style datasets of (input, target). A training set with
    random augmentation draws it from torch's global RNG, as torchvision's transforms do."""
    if args.dummy:
        g = torch.Generator().manual_seed(1234)  # the same data in every process
        templates = torch.rand(10, 28, 28, generator=g) * 255

        def fake(n):
            y = torch.randint(0, 10, (n,), generator=g)
            return (templates[y] + torch.randn(n, 28, 28, generator=g) * 60).clamp(0, 255), y
        return InMemoryMNIST(*fake(60000)), InMemoryMNIST(*fake(10000))
    raw = os.path.join(args.data_dir, "MNIST", "raw")  # checked by prepare_data
    return tuple(InMemoryMNIST(read_idx(os.path.join(raw, f"{split}-images-idx3-ubyte")),
                               read_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte")))
                 for split in ("train", "t10k"))


def make_model(args):
    return Net()


def loss_fn(output, target):
    return F.cross_entropy(output, target, label_smoothing=0.1)  # smoothing: tuned for MNIST


# The optimizer recipe: Adam with betas tuned for MNIST (tuomaso/train_mnist_fast), a linear
# warmup and decay per step, and the LR scaled with the global batch.
BETAS = (0.7, 0.9)
REFERENCE_BATCH = 256  # --lr is the learning rate at this global batch
LR_RULES = {"sqrt": "square-root rule, for Adam", "linear": "linear rule, for SGD",
            "none": "not scaled"}
# Adam's second-moment estimate averages over about 1 / (1 - beta2) steps and is unreliable
# before that: warm up over at least 2 / (1 - beta2) steps (Ma & Yarats 2019, "On the
# adequacy of untuned warmup for adaptive optimization"), however few steps an epoch has.
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


def describe_lr(args):
    return (f"LR {args.lr:g} at batch {REFERENCE_BATCH} -> {peak_lr(args):.4g} at "
            f"{args.batch_size} ({LR_RULES[args.lr_scaling]})")


class Net(nn.Module):
    """Two conv blocks with BatchNorm (so --sync-bn means something) and a small head:
    about 99.3% on MNIST after one epoch with the defaults."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


class InMemoryMNIST(Dataset):
    """MNIST as normalised tensors in memory (190 MB for the training set). DataLoader
    asks `__getitems__` for a whole batch at once, which here is one indexing operation: no
    per-image Python work (`collate` passes the batch through)."""

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
    """An uncompressed IDX file (MNIST's format; check_mnist has read its header) as a tensor."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return torch.frombuffer(data, dtype=torch.uint8, offset=4 + 4 * ndim).view(*dims)


def check_mnist(raw):
    """Read the IDX headers (magic 0x00000803 for images, 0x00000801 for labels, then the sizes)
    and check what torchvision's reader would otherwise fail on with a bare AssertionError."""
    counts = {}
    for name in MNIST_FILES:
        path, ndim = os.path.join(raw, name), 3 if "images" in name else 1
        with open(path, "rb") as f:
            data = f.read() if ndim == 1 else f.read(4 + 4 * ndim)
        magic = data[:4]
        if len(data) < 4 + 4 * ndim or magic != bytes([0, 0, 8, ndim]):
            raise Fatal(f"{path} is not an MNIST {'image' if ndim == 3 else 'label'} file: it "
                        f"starts with 0x{magic.hex() or '(nothing)'}, not 0x0000080{ndim}")
        dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
        if ndim == 3 and dims[1:] != (28, 28):
            raise Fatal(f"{path} holds {dims[1]}x{dims[2]} images; MNIST's are 28x28")
        size, expected = os.path.getsize(path), 4 + 4 * ndim + math.prod(dims)
        if size != expected:
            raise Fatal(f"{path} is {'truncated' if size < expected else 'too long'}: "
                        f"{size} bytes, its header says {expected}")
        if ndim == 1 and dims[0] and max(data[8:]) > 9:
            raise Fatal(f"{path} holds labels up to {max(data[8:])}; MNIST's are 0-9")
        counts[name] = dims[0]
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if images != labels:
            raise Fatal(f"{os.path.join(raw, split)}-*: {images} images but {labels} labels")


# =============================================================================================
# 2. What a learner reads next: metrics over all processes, exact evaluation, checkpoints.
# =============================================================================================

def distributed():
    return dist.is_available() and dist.is_initialized()


# Torch before 2.8 (seen on 2.4 and 2.5: half of 10 evaluations at 3 processes hung on 2.4.1):
# destroy_process_group can deadlock when a gloo thread drops the last reference to the tensor
# of a recent collective while the main thread, holding the GIL, waits for that thread
# (pytorch/pytorch#154976). The tensors of the last collectives stay referenced here.
_recent = collections.deque(maxlen=64)


def kept(t):
    _recent.append(t)
    return t


def reduce_tensor(t):
    """Mean of `t` over all processes (a copy); `t` itself when there is no process group.
    SUM, then divide: gloo has no ReduceOp.AVG in torch 2.4 and 2.5."""
    if not distributed():
        return t
    t = kept(t.clone())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


@torch.no_grad()
def evaluate(model, test_set, device, batch_size, workers=0, rank=0, world_size=1):
    """Exact test accuracy: each process takes every world_size-th sample (no padding, unlike
    DistributedSampler), then the correct and total counts are summed over processes. Pass the
    unwrapped model: DDP's forward may sync buffers, and shards can differ in batch count."""
    if distributed():  # BatchNorm running stats drift apart in training (each process updates
        for b in model.buffers():  # them with its own batches): evaluate rank 0's, the saved ones
            dist.broadcast(b, src=0)
    model.eval()
    shard = Subset(test_set, range(rank, len(test_set), world_size))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                        multiprocessing_context=worker_start(workers),
                        pin_memory=device.type == "cuda", worker_init_fn=worker_init)
    counts = kept(torch.zeros(2, dtype=torch.long, device=device))
    for x, y in start_workers(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        counts[0] += (model(x).argmax(1) == y).sum()
        counts[1] += len(y)
    if distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, total = counts.tolist()
    return correct, total


def checkpoint_state(model, optimizer, scheduler, scaler, epoch, step, args):
    """Plain tensors and values only. `epoch` epochs done, plus `step` steps of the next one."""
    return {"model": model.state_dict(),  # the unwrapped model: no "module." prefix
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "args": vars(args)}


def save_checkpoint(state, path):
    """Write to a temporary file, flush it to the disk, and rename it over `path`: a crash, a
    kill or a full disk mid-write leaves the previous checkpoint intact, never a truncated one.
    torch.save gets a Python file, so a failed write raises OSError with its reason (given a
    path, it reports a full disk as "unexpected pos ..." or "basic_ios::clear")."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = e  # a failed write inside torch.save surfaces as the zip writer's RuntimeError
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise Fatal(f"could not write the checkpoint {path} ({cause.strerror or cause}); the "
                    "previous one, if any, is intact") from None


def load_checkpoint(path, map_location="cpu"):
    """weights_only=True: a checkpoint is data, and unpickling arbitrary objects can run code.
    `path` may also be an open file of its bytes."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise Fatal(f"no checkpoint at {path}") from None
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Fatal(f"checkpoint {path} is corrupt or truncated ({reason[:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise Fatal(f"{path} is not a checkpoint of these scripts (no 'model' entry)")
    return ckpt


def load_model_state(model, state_dict, path):
    """Strict load; a "module." prefix from an old DataParallel/DDP save is stripped first."""
    state_dict = dict(state_dict)
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        detail = " ".join(ln.strip() for ln in str(e).splitlines()[1:3])
        raise Fatal(f"checkpoint {path} does not fit this model: {detail[:300]}") from None


def restore(ckpt, model, optimizer, scheduler, scaler, path):
    """Load a checkpoint into freshly built objects; returns (epoch, step) to continue from."""
    load_model_state(model, ckpt["model"], path)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler") and scaler.is_enabled():  # a checkpoint without fp16 has no scale
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt["epoch"], ckpt.get("step", 0)


NO_RESUME, RESUME_IF_FOUND, RESUME = 0, 1, 2  # what one process asks for


def agreed_checkpoint(path, wish, device, log=print):
    """The checkpoint every process resumes from, or None, decided by all of them together:
    each says what it asks for (`wish`) and which snapshot it sees (nodes can have disks of
    their own). They resume if any asks to and any has a snapshot, all from the newest one; a
    process without it (a node that joins with an empty disk, a requeue onto other nodes, a
    missing mount) or with an older copy receives it from the lowest rank that has it. So no
    process ever runs other collectives than the rest."""
    ckpt = load_checkpoint(path, device) if wish and path and os.path.exists(path) else None
    position = (ckpt["epoch"], ckpt.get("step", 0)) if ckpt else (-1, -1)
    if not distributed():
        everyone = [(wish, *position)]
    else:
        mine = kept(torch.tensor([wish, *position], dtype=torch.long, device=device))
        gathered = [kept(torch.empty_like(mine)) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        everyone = [tuple(t.tolist()) for t in gathered]
    wish = max(w for w, _, _ in everyone)
    newest = max(tuple(p) for _, *p in everyone)
    if wish == NO_RESUME or (newest == (-1, -1) and wish == RESUME_IF_FOUND):
        return None
    if newest == (-1, -1):
        raise Fatal(f"no checkpoint at {path}" + (" on any node" if len(everyone) > 1 else ""))
    behind = [r for r, (_, *p) in enumerate(everyone) if tuple(p) != newest]
    if behind:  # only with several processes: the ranks in `behind` get the newest copy
        source = next(r for r, (_, *p) in enumerate(everyone) if tuple(p) == newest)
        log(f"rank(s) {', '.join(map(str, behind))} had no copy of {path} at {newest[0]} "
            f"epoch(s) + {newest[1]} step(s): rank {source} sends its copy")
        data = None
        if dist.get_rank() == source:
            with open(path, "rb") as f:
                data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(device)
        size = kept(torch.tensor([len(data) if data is not None else 0], device=device))
        dist.broadcast(size, src=source)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=source)
        if dist.get_rank() in behind:
            ckpt = load_checkpoint(io.BytesIO(data.cpu().numpy().tobytes()), device)
    return ckpt


# =============================================================================================
# 3. The machinery: command line, errors, the machine, data loading, the stop agreement on
#    SIGTERM, and reporting.
# =============================================================================================

# ---- Errors: one line each, never a traceback -----------------------------------------------

# gloo's RuntimeErrors for a peer that died or stopped answering: most name a gloo source file;
# a timeout while a rank waits may also end as "Application timeout caused pair closure", and a
# process that waits in init_process_group for one that never comes gets "Wait timeout".
GLOO_LOST_PEER = ("/gloo/", "Application timeout caused pair closure", "Wait timeout")
PREEMPTED = 143  # exit code after a SIGTERM: 128 + 15, what shells report for "terminated"


class Fatal(Exception):
    """A problem with the user's input or environment: reported as one line, exit code 2."""
    code = 2


class Failed(Fatal):
    """A process of the job failed (it has said why): one line, exit code 1, as for a lost peer."""
    code = 1


class Preempted(Exception):
    """SIGTERM arrived and the run stopped: exit code 143, and the message, if any, on stderr."""


def ended(who, code):
    """What ends a launcher whose process `who` exited with `code` (it has said why itself)."""
    return Preempted() if code == PREEMPTED else Failed(f"{who} exited with code {code}")


def say(line, file=None):
    """`line` and its newline in one write: the lines of processes that share a pipe (every
    rank's stderr, under a launcher) stay whole instead of interleaving."""
    file = file or sys.stderr
    try:
        fd = file.fileno()
    except (AttributeError, OSError, ValueError):  # a file object without one (tests)
        file.write(line + "\n")
        file.flush()
        return
    file.flush()
    os.write(fd, (line + "\n").encode())


@contextlib.contextmanager
def clean_exit(who=""):
    """Expected endings are one line on stderr, not a traceback: exit code 2 for bad input, 1 for
    a lost peer, 130 for Ctrl-C and PREEMPTED after a SIGTERM. The exit happens outside the
    `except`, so the frames of the failed code (and any DataLoader workers they hold) are
    released first."""
    code = None
    try:
        yield
    except Fatal as e:
        say(f"{who}error: {e}")
        code = e.code
    except Preempted as e:
        if str(e):
            say(f"{who}preempted: {e}")
        code = PREEMPTED
    except (dist.DistError, RuntimeError) as e:  # a peer died, never came, or the port is taken
        if not isinstance(e, dist.DistError) and not any(m in str(e) for m in GLOO_LOST_PEER):
            raise  # gloo reports a lost peer as RuntimeError; any other one is a real bug
        line = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        line = re.sub(r"^\[\S+\] ", "", line.strip())  # drop gloo's "[source.cc:123] "
        say(f"{who}error: distributed: {line[:300]}")
        # The group is broken: leave without Python's teardown, in which gloo's threads can
        # still abort the process ("terminate called without an active exception", exit -6).
        # What the run wrote is on disk already (metrics and TensorBoard flush every record).
        sys.stdout.flush()
        os._exit(1)
    except KeyboardInterrupt:
        say(f"{who}interrupted")
        code = 130
    if code is not None:
        if code == PREEMPTED and distributed():
            dist.destroy_process_group()  # a clean exit: no gloo thread left (see the import)
        sys.exit(code)


# ---- Command line: one definition, so a flag means the same thing in every script. Each flag's
# accepted range lives in its type=, so a bad value is a one-line error before anything starts.

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # "error: argument --lr: ..." and exit 2, without the usage text
        raise Fatal(message)


def ranged(kind, ok, what):
    """An argparse type= that converts and checks: `ranged(int, lambda v: v > 0, "...")`."""
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return convert


positive_int = ranged(int, lambda v: v > 0, "an integer > 0")
natural_int = ranged(int, lambda v: v >= 0, "an integer >= 0")
positive_float = ranged(float, lambda v: 0 < v < math.inf, "a number > 0")
natural_float = ranged(float, lambda v: 0 <= v < math.inf, "a number >= 0")
port_number = ranged(int, lambda v: 0 < v < 65536, "a port number 1-65535")
gpu_ids = ranged(lambda text: [int(i) for i in text.split(",")],
                 lambda v: all(0 <= i < torch.cuda.device_count() for i in v),
                 "comma-separated ids of this machine's GPUs")


def build_parser(description, processes=True):
    """The shared flags (docs/flags.md). `processes=False` (dp_baseline.py, one process) leaves
    out those that only mean something with several processes."""
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--epochs", type=positive_int, default=1, help="epochs the LR schedule spans (default: %(default)s)")
    a("--stop-after", type=positive_int, metavar="EPOCH", help="end this run after this epoch, "
      "keeping the schedule of --epochs (continue later with --resume)")
    a("--batch-size", type=positive_int, default=256, help="GLOBAL batch over all processes; "
      "each takes batch-size / world-size (default: %(default)s)")
    a("--accumulate", type=positive_int, default=1, metavar="N", help="N forward and backward "
      "passes (micro-batches) per optimizer step, the gradients all-reduced once per step; "
      "--batch-size stays the global batch of one step (default: %(default)s)")
    a("--workers", type=natural_int, default=0, metavar="N", help="data-loading processes per "
      "training process; 0 loads in the training process, which serves in-memory MNIST best "
      "(default: %(default)s)")
    a("--lr", type=positive_float, default=0.01, help=f"peak learning rate at a global batch of "
      f"{REFERENCE_BATCH}, scaled to --batch-size by --lr-scaling (default: %(default)s)")
    a("--lr-scaling", choices=list(LR_RULES), default="sqrt", help="how the LR follows the "
      "global batch: sqrt (Adam, used here), linear (SGD), none (--lr as given) (default: %(default)s)")
    a("--warmup-epochs", type=natural_float, default=0.2, help="linear LR warmup, in epochs, "
      f"at least {MIN_WARMUP_STEPS} steps (default: %(default)s)")
    a("--seed", type=ranged(int, lambda v: 0 <= v < 2 ** 63, "an integer 0 to 2**63-1"),
      default=0, help="seed for weights, shuffling, augmentation and dropout (default: %(default)s)")
    a("--amp", choices=list(AMP_DTYPES), default="none", help="mixed precision: torch.autocast "
      "with this dtype; fp16 adds a GradScaler (default: %(default)s)")
    a("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (CUDA only)")
    a("--channels-last", action="store_true", help="conv weights and input batches in "
      "channels_last (NHWC) memory format: faster convolutions on CPU here (docs/speed.md)")
    a("--compile", action="store_true", help="torch.compile the DDP-wrapped model; the first "
      "steps compile (docs/training.md)")
    a("--checkpoint", metavar="PATH", help="written by one process after every epoch; with it, "
      "a SIGTERM stops every process at the same step and saves there")
    a("--save-every", type=natural_int, default=0, metavar="STEPS", help="also write "
      "--checkpoint every this many steps inside an epoch; a resume continues from that step "
      "(default: %(default)s)")
    if processes:
        a("--save-on-each-node", action="store_true", help="one checkpoint writer per node "
          "(local rank 0) instead of one in all, for nodes without a shared filesystem")
    a("--resume", action="store_true", help="continue from --checkpoint")
    a("--evaluate", action="store_true", help="evaluate the model in --checkpoint and exit")
    a("--metrics", metavar="PATH", help="append one JSON object per epoch (rank 0)")
    a("--tensorboard", metavar="DIR", help="write scalars for TensorBoard (rank 0)")
    a("--log-interval", type=positive_int, default=50, metavar="STEPS",
      help="progress line every this many steps (default: %(default)s)")
    if processes:
        a("--timeout", type=positive_float, default=600, metavar="SECONDS", help="how long a "
          "collective waits for the slowest process, e.g. while rank 0 writes a checkpoint, "
          "before the job fails (default: %(default)s)")
        a("--join-timeout", type=positive_float, default=60, metavar="SECONDS", help="how long "
          "the processes wait for each other at start-up (default: %(default)s)")
    else:
        p.set_defaults(save_on_each_node=False, timeout=None, join_timeout=None)
    add_task_flags(p)  # last: a task may also change the defaults above (set_defaults)
    return p


def check_args(args, world_size, local_processes, one_node=True, process_group=True,
               elastic=False, notes=True, cuda=None):
    """Refuse combinations that cannot work, up front, in the launching process.
    `local_processes`: the training processes on this machine, one per GPU where there are GPUs.
    `one_node`: every process runs here, so a checkpoint to resume from must be here too (with
    several nodes, any node's copy will do: agreed_checkpoint). `process_group`: False for one
    process without one (DataParallel). `elastic`: the script resumes whenever it finds
    --checkpoint (torchrun_ddp.py). `notes`: this process may print notes. `cuda`: whether
    to train on CUDA (default: where there is a GPU)."""
    gpus = torch.cuda.device_count()
    cuda = gpus > 0 if cuda is None else cuda
    if gpus and local_processes > gpus:  # two processes on one GPU: NCCL refuses, or they fight
        raise Fatal(f"--nproc-per-node {local_processes} but this machine has {gpus} GPU(s)")
    if not process_group and args.sync_bn:
        raise Fatal("--sync-bn needs the DDP scripts (spawn_ddp.py): SyncBatchNorm synchronises "
                    "over a process group, and DataParallel has none")
    if not process_group and args.compile:
        raise Fatal("--compile needs the DDP scripts (spawn_ddp.py): PyTorch documents "
                    "torch.compile with DDP, not with DataParallel")
    for flag, path in (("--checkpoint", args.checkpoint), ("--metrics", args.metrics)):
        if path and os.path.isdir(path):
            raise Fatal(f"{flag} {path} is a folder; give a file path")
    if args.batch_size % world_size and not args.evaluate:
        raise Fatal(f"--batch-size {args.batch_size} is the global batch and must divide by the "
                    f"world size {world_size}")
    if args.batch_size % (world_size * args.accumulate) and not args.evaluate:
        raise Fatal(f"--batch-size {args.batch_size} is the global batch of one optimizer step and "
                    f"must divide by world size x --accumulate = {world_size} x {args.accumulate}")
    if args.stop_after is not None and args.stop_after > args.epochs:
        raise Fatal(f"--stop-after {args.stop_after} is past --epochs {args.epochs}")
    if args.warmup_epochs >= args.epochs:
        raise Fatal(f"--warmup-epochs {args.warmup_epochs:g} must be shorter than --epochs "
                    f"{args.epochs}")
    if args.sync_bn and not cuda:
        raise Fatal("--sync-bn needs CUDA: nn.SyncBatchNorm does not train on CPU")
    if process_group and not gpus and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # DDP's constructor reads the gloo group's thread count from DETAIL's wrapper as if it
        # were the group: a read of the wrong object, which crashes or not (troubleshooting.md)
        raise Fatal("TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch's DDP read invalid memory on gloo "
                    "(CPU), and crash or not; use INFO (docs/troubleshooting.md)")
    if args.compile and not cuda and cpp_compiler() is None:  # else a traceback at step 1
        raise Fatal("--compile on a CPU needs a C++ compiler for inductor: none runs as $CXX or "
                    "g++; install g++ or point CXX to one")
    if args.tensorboard:
        try:
            from torch.utils import tensorboard  # noqa: F401
        except ImportError:
            raise Fatal("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if (args.resume or args.evaluate or args.save_every) and not args.checkpoint:
        raise Fatal("--resume, --evaluate and --save-every need --checkpoint PATH")
    if (args.evaluate or args.resume) and one_node and not os.path.exists(args.checkpoint):
        raise Fatal(f"no checkpoint at {args.checkpoint}")
    if (args.evaluate or args.resume or elastic) and args.checkpoint \
            and os.path.isfile(args.checkpoint):  # a bad checkpoint fails here, not in every process
        load_model_state(make_model(args), load_checkpoint(args.checkpoint)["model"],
                         args.checkpoint)
    if notes and args.amp != "none" and not cuda and not (args.amp == "bf16" and fast_bf16_cpu()):
        say(f"warning: --amp {args.amp} on this CPU is slower than fp32: {amp_on_cpu_reason(args.amp)}")


def check_outputs(args, node_rank=0, notes=True):
    """Make sure every file this node will write can be written, before any training: create
    missing folders (saying so) or fail now, not after an epoch of work. Node 0 writes the
    checkpoint (every node with --save-on-each-node), --metrics and --tensorboard."""
    outputs = []
    if args.checkpoint and not args.evaluate and (node_rank == 0 or args.save_on_each_node):
        outputs.append(("--checkpoint", args.checkpoint, False))
    if node_rank == 0:
        outputs += [("--metrics", args.metrics, False), ("--tensorboard", args.tensorboard, True)]
    for flag, path, is_folder in outputs:
        if not path:
            continue
        folder = path if is_folder else os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder)
            if notes:
                print(f"created folder {folder} for {flag}", flush=True)
        except FileExistsError:
            pass
        except OSError as e:
            raise Fatal(f"{flag} {path}: cannot create the folder {folder} ({e.strerror})") from None
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
            if os.path.exists(path) and not is_folder and not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise Fatal(f"{flag} {path}: cannot write in {folder} ({e.strerror})") from None


# ---- The machine: devices, cores, CPU features, the network. Portable: Linux, macOS, Windows.

def process_device(local_rank, local_world_size):
    """This process's device: its own GPU, made current (so that NCCL and every .cuda() use
    it), or the CPU with its share of the cores (otherwise every process uses them all and
    they thrash)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(threads_per_process(local_world_size))
    return torch.device("cpu")


def cpu_count():
    """Cores this process may run on. Linux alone has the affinity mask (containers, taskset,
    SLURM's binding); elsewhere every core counts (Python 3.13+ asks the OS per process)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return (getattr(os, "process_cpu_count", None) or os.cpu_count)() or 1


def threads_per_process(local_world_size):
    """CPU ranks on one machine share its cores; left alone each takes all of them."""
    if "OMP_NUM_THREADS" in os.environ:
        try:
            return positive_int(os.environ["OMP_NUM_THREADS"])
        except argparse.ArgumentTypeError as e:
            raise Fatal(f"OMP_NUM_THREADS: {e}") from None
    return max(1, cpu_count() // local_world_size)


def cpu_features():
    """The CPU features that decide the precision worth using, as PyTorch detects them
    (torch.cpu.get_capabilities; {} on a torch without it)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    return dict(get()) if get else {}


def fast_bf16_cpu():
    """Whether this CPU has bfloat16 arithmetic: AVX512_BF16 or AMX on x86, BF16 on ARM. Without
    it, oneDNN emulates bf16 and autocast is slower than fp32 (docs/training.md). Unknown
    (a torch without get_capabilities): assume it has, and keep what the user asked for."""
    caps = cpu_features()
    return not caps or any(caps.get(k) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))


def amp_on_cpu_reason(amp):
    if amp == "fp16":
        return "float16 autocast on a CPU ran many times slower than fp32 (docs/training.md)"
    return "it has no bfloat16 instructions (AVX512_BF16, AMX or ARM BF16), so bf16 is emulated"


def cpp_compiler():
    """The C++ compiler inductor will build CPU kernels with, found the way it searches ($CXX,
    else g++, run with --version), or None."""
    try:  # inductor's own search; a private API, so a plain PATH lookup if it moves
        from torch._inductor import cpp_builder, exc
        find, invalid = cpp_builder.get_cpp_compiler, exc.InvalidCxxCompiler
    except (ImportError, AttributeError):
        return shutil.which(os.environ.get("CXX", "g++"))
    try:
        return find()
    except invalid:
        return None


def loopback_interface():
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), or None."""
    if sys.platform == "darwin":
        return "lo0"
    with contextlib.suppress(AttributeError, OSError):
        names = [name for _, name in socket.if_nameindex()]
        return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)
    return None


def on_loopback():
    """For a job whose processes all run on this machine: gloo and NCCL open their sockets on
    the loopback interface, where no other machine can reach them (by default they listen on
    the address the hostname resolves to, which on a laptop may be none, or a Wi-Fi address that
    changes: pytorch/pytorch#26049). Variables the user set win. docs/security.md."""
    lo = loopback_interface()
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def loopback_store(port, world_size, is_master, timeout):
    """A TCP store that listens on 127.0.0.1 only, for processes that all run on this machine.
    TCPStore listens on every interface whatever address it is given (pytorch/pytorch#173909):
    its host gets a socket already bound to loopback instead (docs/security.md)."""
    listening = None
    if is_master:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            listening = s.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, world_size, is_master, timeout=timeout,
                             master_listen_fd=listening)
    except NotImplementedError:  # torch < 2.6: libuv's store takes no socket; the older one does
        return dist.TCPStore("127.0.0.1", port, world_size, is_master, timeout=timeout,
                             master_listen_fd=listening, use_libuv=False)


def check_port_free(port):
    """Whether the store can listen on `port`. With SO_REUSEADDR, as the store's own socket
    has: the connections of a run that just ended (TIME_WAIT, a minute or two) do not count."""
    with socket.socket() as s:
        if os.name != "nt":  # on Windows the option would let two sockets share a port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise Fatal(f"port {port} is already in use on this machine; choose another "
                        "--master-port") from None


def same_nproc_on_every_node(store, nproc, node_rank, nnodes, rank):
    """Every node publishes its number of processes in the store and reads the others': nodes
    that disagree would compute colliding global ranks. Then every process of every node fails
    with one line, before the process group forms; rank 0, which hosts the store, waits until
    all have read it."""
    store.set(f"nproc/{node_rank}", str(nproc))
    counts = [int(store.get(f"nproc/{n}")) for n in range(nnodes)]
    if len(set(counts)) > 1:
        store.add("nproc/read", 1)
        deadline = time.monotonic() + store.timeout.total_seconds()
        while rank == 0 and store.add("nproc/read", 0) < sum(counts) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise Fatal(f"every node must run the same --nproc-per-node; nodes 0..{nnodes - 1} "
                    f"run {', '.join(map(str, counts))}")


# ---- Data loading: the pieces of the DataLoader path that make it exact under DDP ----------

def collate(samples):
    """DataLoader's collate_fn: default_collate for a list of (input, target) samples; a batch
    that a dataset's __getitems__ made whole (a tuple of tensors) passes through."""
    return samples if isinstance(samples, tuple) else default_collate(samples)


def mix(*values):
    """A 63-bit seed from a tuple of integers, well spread (blake2b)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PerSampleSeeds(Dataset):
    """Wraps a training set so that whatever it draws from torch's (and Python's) global RNG,
    random augmentation above all, is seeded per sample from (seed, epoch, index). So it
    differs on every rank and in every epoch, and does not depend on the number of processes or
    workers, nor on where a resume started: DataLoader would otherwise seed its workers from
    each process's RNG, the same on every rank. The epoch sits in shared memory, so that workers
    see set_epoch() too, persistent ones included. A dataset that returns whole batches
    (__getitems__) is seeded once per batch, from its first index."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()
        if callable(getattr(dataset, "__getitems__", None)):
            self.__getitems__ = self._getitems

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def _seed(self, index):
        seed = mix(self.seed, int(self.epoch), int(index))
        torch.default_generator.manual_seed(seed)
        random.seed(seed)

    def __getitem__(self, index):
        self._seed(index)
        return self.dataset[index]

    def _getitems(self, indices):
        self._seed(indices[0])
        return self.dataset.__getitems__(indices)


def seed_step(seed, epoch, step, rank):
    """Seed this process's RNG from (seed, epoch, step, rank) before a forward pass: dropout and
    any other random layer draw differently on every rank, and exactly again after a resume.
    With --accumulate N the scripts pass rank r + W*k for micro-batch k, the rank that would
    compute it with N times the processes."""
    seed = mix(seed, epoch, step, rank)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)  # this process's GPU (dropout on CUDA draws from it)


class ResumableSampler(Sampler):
    """A sampler whose next pass leaves out its first `skip` indices: a mid-epoch resume skips
    the batches already trained in the sampler, so nothing is loaded for them."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


def worker_start(workers):
    """The DataLoader's multiprocessing_context: workers forked from a fork server (a process of
    its own), not from the training process. A training process runs the process group's
    threads, and gloo's takes and drops a Python thread state after each collective; a worker
    forked at that instant hangs before its first line on CPython before 3.11.10 and 3.10.15
    (python/cpython#112275), and its training process waits for a batch until --timeout
    (docs/training.md). Python 3.12 warns about fork() in a process with threads, and 3.14 makes
    the fork server the default. The server starts here, with SIGTERM blocked: a signal to the
    whole job leaves it, and the workers it forks (start_workers), to their training process.
    None for workers=0, and where there is no fork server (Windows). The server imports torch
    and torchvision, not every worker each epoch (a task needing another heavy package can add
    it); not this repo's modules: Python 3.11's server ignores the training process's sys.path
    and could find another common.py."""
    if not workers or "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver, resource_tracker
    forkserver.set_forkserver_preload(["torch", "torchvision"])  # not ours: see the docstring
    resource_tracker.ensure_running()  # before the block: starting the tracker unblocks SIGTERM
    with sigterm_blocked():
        forkserver.ensure_running()
    return torch.multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def sigterm_blocked():
    """SIGTERM blocked in this thread, and in every process started meanwhile (a signal mask
    survives fork and exec); a no-op where there are no signal masks (Windows)."""
    before = None
    if hasattr(signal, "pthread_sigmask"):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_workers(loader):
    """iter(loader), with SIGTERM blocked while the loader starts its worker processes: each
    worker, and every thread it starts before worker_init runs (numpy's OpenBLAS starts one at
    fork), starts with it blocked (from the fork server's mask, or this thread's), and
    worker_init takes it from there."""
    if not loader.num_workers:
        return iter(loader)
    with sigterm_blocked():
        return iter(loader)


def worker_init(worker_id):
    """DataLoader's worker_init_fn. A SIGTERM to the whole job (SLURM's scancel, torchrun's
    os.killpg on each rank's process group) also reaches the data workers, and PyTorch's handler
    lets a worker die of one that its parent did not send; its training process then fails
    before it can save. Here a worker exits on a SIGTERM from its training process (the
    DataLoader shutting it down), as before, and ignores one from anybody else: the training
    process stops the run, and its workers with it. Linux (signal.sigwaitinfo, with SIGTERM
    blocked by start_workers); elsewhere the workers keep PyTorch's handler."""
    if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
        parent = torch.multiprocessing.parent_process().pid  # not the fork server: getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # and in later threads

        def wait_for_sigterm():
            while True:
                if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                    os._exit(0)  # what PyTorch's handler does for a SIGTERM from the parent
        threading.Thread(target=wait_for_sigterm, name="sigterm", daemon=True).start()
    elif hasattr(signal, "pthread_sigmask"):  # macOS: as PyTorch has it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def micro_batches(x, y, n):
    """One process's batch as n micro-batches for --accumulate: (k, x, y, share, last). Micro-batch
    k takes every n-th sample from the k-th, which is exactly the batch that rank r + W*k of
    W*n processes would get (DistributedSampler deals a global batch out to the ranks in turn).
    Each micro-batch's loss is weighted by its share of the batch, so that the gradients add
    up to the gradient of the mean loss over the whole batch."""
    n = min(n, len(y))  # a last batch shorter than n gives no empty micro-batch
    for k in range(n):
        yk = y[k::n]
        yield k, x[k::n], yk, len(yk) / len(y), k == n - 1


def sync_on(last, model):
    """DDP all-reduces in the backward of every forward run outside no_sync(), so with
    --accumulate only the last micro-batch runs outside it, its forward included."""
    return contextlib.nullcontext() if last else model.no_sync()


class SchedulerAfterScaler:
    """Steps the LR schedule after each optimizer step, unless fp16's GradScaler skipped it (a
    gradient overflowed: it lowers the scale and does not step), so that the schedule stays in
    line with the optimizer (pytorch/pytorch#44511). One get_scale() per step with fp16, a GPU
    sync; none without a scaler."""

    def __init__(self, scheduler, scaler):
        self.scheduler, self.scaler = scheduler, scaler
        self.scale = scaler.get_scale() if scaler.is_enabled() else None

    def step(self):
        if self.scale is not None:
            before, self.scale = self.scale, self.scaler.get_scale()
            if self.scale < before:
                return
        self.scheduler.step()


# ---- Stopping on SIGTERM: what SLURM, Kubernetes and torchrun send before they kill a job ---

class StopSignal:
    """What a SIGTERM does to a run.

    Without a checkpoint there is nothing to save: it stops the process at once, as Ctrl-C
    does. With one, it turns into a stop at the same step in every process, so that the snapshot
    is one model: the handler only sets a flag. Every step, each process adds its flag to a
    one-number all-reduce that runs in the background, and reads the sum of the one it started
    a step before: no process waits for another, all read the same sums at the same steps, so
    all stop together, one or two steps after the signal. The sum goes through gloo on the CPU
    (a gloo side group when training uses NCCL), so reading it never waits for the GPU."""

    def __init__(self, snapshot):
        self.received = self.agreed = False
        self.flag, self.pending, self.group = torch.zeros(1), None, None
        self.distributed = snapshot and distributed() and dist.get_world_size() > 1
        if self.distributed and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank() if distributed() else 0
        signal.signal(signal.SIGTERM, self._received if snapshot else self._stop_now)

    def _received(self, signum, frame):
        self.received = True

    def _stop_now(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: once is enough
        raise Preempted("stopped on SIGTERM; nothing saved (no --checkpoint)"
                        if self.rank == 0 else "")

    def __call__(self):
        """Called by every process before every step: True when all are to stop here."""
        if not self.distributed or self.agreed:
            self.agreed = self.agreed or self.received
            return self.agreed
        if self.pending is not None:
            self.pending.wait()
            self.agreed = self.flag.item() > 0
            if self.agreed:
                self.pending = None
                return True
        self.flag.fill_(float(self.received))
        self.pending = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return False

    def stopped(self, args, epoch, step):
        """The exception that ends the run after the snapshot at `step` of `epoch`."""
        where = f"snapshot in {args.checkpoint}: rerun with --resume to continue"
        return Preempted(f"stopped on SIGTERM after step {step} of epoch {epoch + 1}; {where}"
                         if self.rank == 0 else "")

    def close(self):
        """Before destroy_process_group: a pending reduction would keep the group alive."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- Reporting: console, --metrics and --tensorboard, from rank 0 only ----------------------

class Reporter:
    def __init__(self, args, rank, world_size):
        self.on = rank == 0
        self.args, self.world_size = args, world_size
        self.tb = None
        if self.on and args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(args.tensorboard)

    def log(self, msg):
        if self.on:
            print(msg, flush=True)

    def progress(self, epoch, step, steps, loss, lr, stats):
        samples_per_s = stats.seen * self.world_size / max(stats.seconds(), 1e-9)
        self.log(f"epoch {epoch + 1}/{self.args.epochs} step {step}/{steps} loss {loss:.4f} "
                 f"lr {lr:.3g} {samples_per_s:.0f} samples/s")

    def record(self, **fields):
        """One epoch (or one evaluation): a console line, a JSON line, TensorBoard scalars."""
        if not self.on:
            return
        fields["world_size"] = self.world_size
        self.log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in fields.items()))
        if self.args.metrics:
            with open(self.args.metrics, "a") as f:
                f.write(json.dumps(fields) + "\n")
        if self.tb is not None:
            for k, v in fields.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    self.tb.add_scalar(k, v, fields.get("epoch", 0))
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def say_once(what, device):
    """Rank 0's first line: the processes, the backend, the device and the threads."""
    if not distributed() or dist.get_rank() == 0:
        backend = f", backend {dist.get_backend()}" if distributed() else ""
        print(f"{what}{backend}, device {device.type}, {torch.get_num_threads()} thread(s) each",
              flush=True)


def accuracy_fields(correct, total):
    return {"test_acc": 100.0 * correct / total, "correct": correct, "total": total}


class EpochStats:
    """One epoch of one process: its loss summed on the device (no sync per step), the samples
    it trained, the wall time (waiting for queued GPU work) and the time spent waiting for
    batches."""

    def __init__(self, device):
        self.device = device
        self.start = self.now()
        self.loss_sum, self.seen, self.data_wait = torch.zeros((), device=device), 0, 0.0

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def seconds(self):
        return self.now() - self.start

    def timed(self, batches):
        """The batches of a DataLoader, adding up how long the loop waits for each."""
        batches = start_workers(batches)
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            self.data_wait += time.perf_counter() - start
            if batch is None:
                return
            yield batch

    def add(self, loss, n):
        self.loss_sum += loss.detach() * n
        self.seen += n

    def speed(self, world_size):
        """The epoch's seconds, samples per second over all processes, and the share of the
        time spent waiting for batches."""
        seconds = self.seconds()
        return {"epoch_seconds": seconds, "samples_per_s": self.seen * world_size / seconds,
                "data_wait": self.data_wait / seconds}
