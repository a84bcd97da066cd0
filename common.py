"""What every launch script shares and none of them is about: the CLI, the model, MNIST as
in-memory tensors, metric reduction, exact evaluation, checkpoint I/O, the LR schedule and
rank-0 reporting. How processes start and talk to each other lives in the scripts."""
import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
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
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCE_BATCH = 256  # --lr is the learning rate for this global batch (linear scaling rule)


class Fatal(Exception):
    """A problem with the user's input or environment: reported as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Command line: one definition, so a flag means the same thing in every script.

def build_parser(description):
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--data-dir", default="./data", help="MNIST root (torchvision layout); downloaded there once "
      "if missing (default: ./data)")
    a("--dummy", action="store_true", help="synthetic data with MNIST's shapes, no files needed")
    a("--epochs", type=int, default=1, help="epochs the LR schedule spans (default: 1)")
    a("--stop-after", type=int, metavar="EPOCH", help="end this run after this epoch, keeping "
      "the schedule of --epochs (continue later with --resume)")
    a("--batch-size", type=int, default=256, help="GLOBAL batch over all processes; each takes "
      "batch-size / world-size (default: 256)")
    a("--lr", type=float, default=0.01, help=f"peak learning rate for a global batch of "
      f"{REFERENCE_BATCH}, scaled linearly with --batch-size (default: 0.01)")
    a("--warmup-epochs", type=float, default=0.2, help="linear LR warmup, in epochs (default: 0.2)")
    a("--seed", type=int, default=0, help="seed for weights and shuffling (default: 0)")
    a("--amp", choices=sorted(AMP_DTYPES), default="none", help="mixed precision: torch.autocast "
      "with this dtype; fp16 adds a GradScaler (default: none)")
    a("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (CUDA only)")
    a("--channels-last", action="store_true", help="keep conv weights in channels_last (NHWC) "
      "memory format: faster convolutions on CPU here, see README")
    a("--checkpoint", metavar="PATH", help="written after every epoch by one process")
    a("--save-every", type=int, default=0, metavar="STEPS", help="also write --checkpoint every "
      "this many steps inside an epoch; a resume continues from that step (default: off)")
    a("--save-on-each-node", action="store_true", help="one checkpoint writer per node (local "
      "rank 0) instead of one in all, for nodes without a shared filesystem")
    a("--resume", action="store_true", help="continue from --checkpoint")
    a("--evaluate", action="store_true", help="evaluate the model in --checkpoint and exit")
    a("--metrics", metavar="PATH", help="append one JSON object per epoch (rank 0)")
    a("--tensorboard", metavar="DIR", help="write scalars for TensorBoard (rank 0)")
    a("--log-interval", type=int, default=50, metavar="STEPS",
      help="progress line every this many steps (default: 50)")
    a("--timeout", type=float, default=60, metavar="SECONDS", help="how long to wait for a "
      "missing or dead peer before failing (default: 60)")
    return p


def check_args(args, world_size, cuda):
    """Refuse bad input up front, in the launching process, before any worker starts."""
    if args.batch_size % world_size and not args.evaluate:
        raise Fatal(f"--batch-size {args.batch_size} is the global batch and must divide by the "
                    f"world size {world_size}")
    if args.sync_bn and not cuda:
        raise Fatal("--sync-bn needs CUDA: nn.SyncBatchNorm does not train on CPU")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise Fatal("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if (args.resume or args.evaluate or args.save_every) and not args.checkpoint:
        raise Fatal("--resume, --evaluate and --save-every need --checkpoint PATH")
    if args.save_every < 0:
        raise Fatal("--save-every must be a positive number of steps (or 0: off)")
    if args.evaluate or args.resume:  # a bad checkpoint fails here, not in every worker
        load_model_state(Net(), load_checkpoint(args.checkpoint)["model"], args.checkpoint)


@contextlib.contextmanager
def clean_exit(who=""):
    """Expected failures end the process with one line on stderr, not a traceback."""
    try:
        yield
    except Fatal as e:
        print(f"{who}error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (dist.DistError, RuntimeError) as e:  # a peer died, never came, or the port is taken
        if not isinstance(e, dist.DistError) and "/gloo/" not in str(e):
            raise  # gloo reports a lost peer as RuntimeError; any other one is a real bug
        line = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        line = re.sub(r"^\[\S+\] ", "", line.strip())  # drop gloo's "[source.cc:123] "
        print(f"{who}error: distributed: {line[:300]}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{who}interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


def threads_per_process(local_world_size):
    """CPU ranks on one machine share its cores; left alone each takes all of them."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            raise Fatal(f"port {port} is already in use on this machine; choose another "
                        "--master-port") from None


# ---------------------------------------------------------------------------------------------
# Model

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


# ---------------------------------------------------------------------------------------------
# Data: the whole of MNIST as normalised tensors in memory, so a batch is one indexing operation.

def prepare_data(args):
    """Download MNIST if missing. Call once, in the launching process, before workers start:
    several processes downloading into one folder corrupt it. Each download goes to a private
    folder first and its files are moved in with os.replace, so two nodes sharing a disk are
    safe too."""
    if args.dummy:
        return
    raw = os.path.join(args.data_dir, "MNIST", "raw")
    if all(os.path.exists(os.path.join(raw, f)) for f in MNIST_FILES):
        return
    from torchvision.datasets import MNIST
    os.makedirs(raw, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".download-", dir=args.data_dir)
    try:
        MNIST(tmp, train=True, download=True)
        for f in MNIST_FILES:
            os.replace(os.path.join(tmp, "MNIST", "raw", f), os.path.join(raw, f))
    except Exception as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise Fatal(f"MNIST is not in {raw} (needs {', '.join(MNIST_FILES)}) and could not be "
                    f"downloaded ({reason}); copy the files there, or use --dummy") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _normalise(images):
    return ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)


def load_mnist(args, device):
    """(train TensorDataset, test images, test labels), all on `device`, already normalised."""
    if args.dummy:
        g = torch.Generator().manual_seed(1234)  # the same data on every rank
        templates = torch.rand(10, 28, 28, generator=g) * 255

        def fake(n):
            y = torch.randint(0, 10, (n,), generator=g)
            noise = torch.randn(n, 28, 28, generator=g) * 60
            return (templates[y] + noise).clamp(0, 255).to(torch.uint8), y
        (tx, ty), (vx, vy) = fake(60000), fake(10000)
    else:
        from torchvision.datasets import MNIST
        try:
            train, test = (MNIST(args.data_dir, train=t, download=False) for t in (True, False))
        except RuntimeError as e:
            raise Fatal(f"cannot read MNIST from {args.data_dir}: {e}") from None
        (tx, ty), (vx, vy) = (train.data, train.targets), (test.data, test.targets)
    return (TensorDataset(_normalise(tx).to(device), ty.to(device)),
            _normalise(vx).to(device), vy.to(device))


class TimedLoader(DataLoader):
    """A DataLoader that also adds up how long the loop waits for its batches: `wait_seconds`,
    reset at the start of each pass (reported as the epoch's `data_wait` share)."""

    def __iter__(self):
        self.wait_seconds, batches = 0.0, super().__iter__()
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            self.wait_seconds += time.perf_counter() - start
            if batch is None:
                return
            yield batch


def batch_loader(dataset, sampler, batch_size):
    """DataLoader that asks the dataset for a whole batch of indices at once. A TensorDataset
    indexes every tensor with the list, so there is no per-item Python work or collation."""
    return TimedLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False),
                       batch_size=None)


# ---------------------------------------------------------------------------------------------
# Metrics across processes

def reduce_tensor(t):
    """Mean of `t` over all processes: all-reduce SUM, then divide (gloo had no ReduceOp.AVG).
    Returns `t` itself when there is no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


@torch.no_grad()
def evaluate(model, images, labels, rank=0, world_size=1, batch_size=1000):
    """Exact test accuracy: each process takes every world_size-th image (no padding, unlike
    DistributedSampler), then correct and total counts are summed over processes. Pass the
    unwrapped model: DDP's forward may sync buffers, and shards can differ in batch count."""
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # BatchNorm running stats drift apart in training (each process updates
        for b in model.buffers():  # them with its own batches): evaluate rank 0's, the saved ones
            dist.broadcast(b, src=0)
    model.eval()
    images, labels = images[rank::world_size], labels[rank::world_size]
    counts = torch.zeros(2, dtype=torch.long, device=labels.device)
    for i in range(0, len(labels), batch_size):
        pred = model(images[i:i + batch_size]).argmax(1)
        counts[0] += (pred == labels[i:i + batch_size]).sum()
    counts[1] = len(labels)
    if distributed:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, total = counts.tolist()
    return correct, total


# ---------------------------------------------------------------------------------------------
# Optimisation

def seed_everything(seed):
    torch.manual_seed(seed)  # same seed on every rank: identical initial weights


def make_optimizer(model, args):
    """Adam with the peak LR scaled linearly by the global batch (LR per REFERENCE_BATCH)."""
    lr = args.lr * args.batch_size / REFERENCE_BATCH
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.7, 0.9))


def make_scheduler(optimizer, args, steps_per_epoch):
    """Per-step linear warmup from ~0 to the peak LR, then linear decay to 0 at --epochs."""
    total = max(1, args.epochs * steps_per_epoch)
    warmup = max(1, min(total - 1, round(args.warmup_epochs * steps_per_epoch)))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / (total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------
# Checkpoints: plain tensors and primitives only, written atomically by one process.

def checkpoint_state(model, optimizer, scheduler, scaler, epoch, step, args):
    """`epoch` epochs done, plus `step` steps of the next one (0 at an epoch's end)."""
    return {"model": model.state_dict(),  # the unwrapped model: no "module." prefix
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "args": vars(args)}


def save_checkpoint(state, path):
    """Write to a temporary file and rename it over `path`: a crash or kill mid-write leaves the
    previous checkpoint intact, never a truncated one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, map_location="cpu"):
    """weights_only=True: a checkpoint is data, and unpickling arbitrary objects can run code."""
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


def same_everywhere(*values, device):
    """True when every process passed the same integers. Per-node checkpoint copies can
    disagree if a crash landed between two nodes' writes; resuming from both would hang."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    lo = torch.tensor(values, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)


# ---------------------------------------------------------------------------------------------
# Reporting: console, --metrics and --tensorboard, from rank 0 only.

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

    def progress(self, epoch, step, steps, loss, lr, seconds, samples):
        self.log(f"epoch {epoch + 1}/{self.args.epochs} step {step}/{steps} loss {loss:.4f} "
                 f"lr {lr:.3g} {samples / max(seconds, 1e-9):.0f} samples/s")

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


def accuracy_fields(correct, total):
    return {"test_acc": 100.0 * correct / total, "correct": correct, "total": total}


class Timer:
    """Wall time that waits for queued GPU work before reading the clock."""

    def __init__(self, device):
        self.device = device
        self.start = self.now()

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed(self):
        return self.now() - self.start
