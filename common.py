"""What every launch script shares and none of them is about: the CLI and its checks, the
machine, the model, MNIST as in-memory tensors, metric reduction, exact evaluation, the LR rule,
checkpoint I/O, stopping on SIGTERM and rank-0 reporting. How processes start and talk to each
other lives in the scripts."""
import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
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
REFERENCE_BATCH = 256  # --lr is the learning rate at this global batch
LR_RULES = {"sqrt": "square-root rule, for Adam", "linear": "linear rule, for SGD",
            "none": "not scaled"}
# gloo's RuntimeErrors for a peer that died or stopped answering: most name a gloo source file;
# a timeout while a rank waits may also end as "Application timeout caused pair closure".
GLOO_LOST_PEER = ("/gloo/", "Application timeout caused pair closure")
PREEMPTED = 143  # exit code after a SIGTERM: 128 + 15, what shells report for "terminated"
BETAS = (0.7, 0.9)  # Adam's
# Adam's second-moment estimate averages over about 1 / (1 - beta2) steps and is unreliable
# before that: warm up over at least 2 / (1 - beta2) steps (Ma & Yarats 2019, "On the
# adequacy of untuned warmup for adaptive optimization"), however few steps an epoch has.
MIN_WARMUP_STEPS = round(2 / (1 - BETAS[1]))  # 20


class Fatal(Exception):
    """A problem with the user's input or environment: reported as one line, exit code 2."""
    code = 2


class Failed(Fatal):
    """A process of the job failed (it has said why): one line, exit code 1, as for a lost peer."""
    code = 1


class Preempted(Exception):
    """SIGTERM arrived and every process stopped at the same step, after the snapshot."""

    def __init__(self, args=None, epoch=0, step=0, say=False):
        where = (f"snapshot in {args.checkpoint}: rerun with --resume to continue"
                 if args and args.checkpoint else "nothing saved (no --checkpoint)")
        super().__init__(f"stopped on SIGTERM after step {step} of epoch {epoch + 1}; {where}"
                         if say else "")


# ---------------------------------------------------------------------------------------------
# Command line: one definition, so a flag means the same thing in every script. Each flag's
# accepted range lives in its type=, so a bad value is a one-line error before anything starts.

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


def build_parser(description, processes=True):
    """The shared flags. `processes=False` (dp_baseline.py, one process) leaves out the two
    that only mean something with several processes: --timeout and --save-on-each-node."""
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--data-dir", default="./data", help="MNIST root (torchvision layout); downloaded there once "
      "if missing (default: ./data)")
    a("--dummy", action="store_true", help="synthetic data with MNIST's shapes, no files needed")
    a("--epochs", type=positive_int, default=1, help="epochs the LR schedule spans (default: 1)")
    a("--stop-after", type=positive_int, metavar="EPOCH", help="end this run after this epoch, "
      "keeping the schedule of --epochs (continue later with --resume)")
    a("--batch-size", type=positive_int, default=256, help="GLOBAL batch over all processes; "
      "each takes batch-size / world-size (default: 256)")
    a("--accumulate", type=positive_int, default=1, metavar="N", help="N forward and backward "
      "passes (micro-batches) per optimizer step, the gradients all-reduced once per step; "
      "--batch-size stays the global batch of one step (default: 1)")
    a("--lr", type=positive_float, default=0.01, help=f"peak learning rate at a global batch of "
      f"{REFERENCE_BATCH}, scaled to --batch-size by --lr-scaling (default: 0.01)")
    a("--lr-scaling", choices=list(LR_RULES), default="sqrt", help="how the LR follows the "
      "global batch: sqrt (Adam, used here), linear (SGD), none (--lr as given) (default: sqrt)")
    a("--warmup-epochs", type=natural_float, default=0.2, help="linear LR warmup, in epochs, "
      f"at least {MIN_WARMUP_STEPS} steps (default: 0.2)")
    a("--seed", type=ranged(int, lambda v: 0 <= v < 2 ** 63, "an integer 0 to 2**63-1"),
      default=0, help="seed for weights and shuffling (default: 0)")
    a("--amp", choices=list(AMP_DTYPES), default="none", help="mixed precision: torch.autocast "
      "with this dtype; fp16 adds a GradScaler (default: none)")
    a("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (CUDA only)")
    a("--channels-last", action="store_true", help="keep conv weights in channels_last (NHWC) "
      "memory format: faster convolutions on CPU here, see README")
    a("--compile", action="store_true", help="torch.compile the model (the DDP-wrapped one in "
      "the DDP scripts); the first steps compile (README, torch.compile)")
    a("--checkpoint", metavar="PATH", help="written by one process after every epoch, and "
      "where a SIGTERM stops the run")
    a("--save-every", type=natural_int, default=0, metavar="STEPS", help="also write "
      "--checkpoint every this many steps inside an epoch; a resume continues from that step "
      "(default: 0, off)")
    if processes:
        a("--save-on-each-node", action="store_true", help="one checkpoint writer per node "
          "(local rank 0) instead of one in all, for nodes without a shared filesystem")
    a("--resume", action="store_true", help="continue from --checkpoint")
    a("--evaluate", action="store_true", help="evaluate the model in --checkpoint and exit")
    a("--metrics", metavar="PATH", help="append one JSON object per epoch (rank 0)")
    a("--tensorboard", metavar="DIR", help="write scalars for TensorBoard (rank 0)")
    a("--log-interval", type=positive_int, default=50, metavar="STEPS",
      help="progress line every this many steps (default: 50)")
    if processes:
        a("--timeout", type=positive_float, default=60, metavar="SECONDS", help="how long to "
          "wait for a missing or dead peer before failing (default: 60)")
    else:
        p.set_defaults(save_on_each_node=False, timeout=None)
    return p


def check_args(args, world_size, cuda, say=True):
    """Refuse combinations that cannot work, up front, in the launching process. `say`: this
    process may print notes (one process per machine does)."""
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
    if args.compile and not cuda and cpp_compiler() is None:  # else a traceback at step 1
        raise Fatal("--compile on a CPU needs a C++ compiler for inductor: none runs as $CXX or "
                    "g++; install g++ or point CXX to one")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise Fatal("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if (args.resume or args.evaluate or args.save_every) and not args.checkpoint:
        raise Fatal("--resume, --evaluate and --save-every need --checkpoint PATH")
    if args.evaluate or args.resume:  # a bad checkpoint fails here, not in every worker
        load_model_state(Net(), load_checkpoint(args.checkpoint)["model"], args.checkpoint)
    if say and args.amp != "none" and not cuda and not (args.amp == "bf16" and fast_bf16_cpu()):
        print(f"warning: --amp {args.amp} on this CPU is slower than fp32: {amp_on_cpu_reason(args.amp)}",
              file=sys.stderr, flush=True)


def check_outputs(args, node_rank=0, say=True):
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
            if say:
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


@contextlib.contextmanager
def clean_exit(who=""):
    """Expected endings are one line on stderr, not a traceback: exit code 2 for bad input, 1 for
    a lost peer, 130 for Ctrl-C and PREEMPTED after a SIGTERM."""
    try:
        yield
    except Fatal as e:
        print(f"{who}error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.code)
    except Preempted as e:
        if str(e):
            print(f"{who}preempted: {e}", file=sys.stderr, flush=True)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a clean exit: no gloo thread left (see the import)
        sys.exit(PREEMPTED)
    except (dist.DistError, RuntimeError) as e:  # a peer died, never came, or the port is taken
        if not isinstance(e, dist.DistError) and not any(m in str(e) for m in GLOO_LOST_PEER):
            raise  # gloo reports a lost peer as RuntimeError; any other one is a real bug
        line = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        line = re.sub(r"^\[\S+\] ", "", line.strip())  # drop gloo's "[source.cc:123] "
        print(f"{who}error: distributed: {line[:300]}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{who}interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


# ---------------------------------------------------------------------------------------------
# The machine: cores, CPU features, ports. Portable: Linux, macOS and Windows.

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
    (torch.cpu.get_capabilities, public in torch 2.14; {} on a torch without it)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    return dict(get()) if get else {}


def fast_bf16_cpu():
    """Whether this CPU has bfloat16 arithmetic: AVX512_BF16 or AMX on x86, BF16 on ARM. Without
    it, oneDNN emulates bf16 and autocast is slower than fp32 (README, Mixed precision). Unknown
    (a torch without get_capabilities): assume it has, and keep what the user asked for."""
    caps = cpu_features()
    return not caps or any(caps.get(k) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))


def amp_on_cpu_reason(amp):
    if amp == "fp16":
        return "float16 autocast on a CPU ran many times slower than fp32 (README, Mixed precision)"
    return "it has no bfloat16 instructions (AVX512_BF16, AMX or ARM BF16), so bf16 is emulated"


def cpp_compiler():
    """The C++ compiler inductor will build CPU kernels with, found the way it searches ($CXX,
    else g++, run with --version), or None."""
    try:  # inductor's own search; a private API, so a plain PATH lookup if it moves
        from torch._inductor import cpp_builder, exc
    except ImportError:
        return shutil.which(os.environ.get("CXX", "g++"))
    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return None


def gloo_on_loopback():
    """For a group whose processes all run on this machine. gloo listens on the address the
    hostname resolves to; on a Mac that is often none, or a Wi-Fi address that changes
    (pytorch/pytorch#26049), so use the loopback interface there, as PyTorch's own macOS CI
    does. An explicit GLOO_SOCKET_IFNAME wins."""
    if sys.platform == "darwin":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0")


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
    """Download MNIST if missing, then check its four files. Call once, in the launching process,
    before workers start: several processes downloading into one folder corrupt it. Each
    download goes to a private folder first and its files are moved in with os.replace, so two
    nodes sharing a disk are safe too."""
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


def micro_batches(x, y, n):
    """One process's batch as n micro-batches for --accumulate: (x, y, share, last). Micro-batch
    k takes every n-th sample from the k-th, which is exactly the batch that rank r + W*k of
    W*n processes would get (DistributedSampler deals a global batch out to the ranks in turn).
    Each micro-batch's loss is weighted by its share of the batch, so that the gradients add
    up to the gradient of the mean loss over the whole batch."""
    n = min(n, len(y))  # a last batch shorter than n gives no empty micro-batch
    for k in range(n):
        yk = y[k::n]
        yield x[k::n], yk, len(yk) / len(y), k == n - 1


def sync_on(last, model):
    """DDP all-reduces in the backward of every forward run outside no_sync(), so with
    --accumulate only the last micro-batch runs outside it, its forward included."""
    return contextlib.nullcontext() if last else model.no_sync()


# ---------------------------------------------------------------------------------------------
# Metrics across processes

def reduce_tensor(t):
    """Mean of `t` over all processes (a copy); `t` itself when there is no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # gloo supports AVG in torch 2.14, NCCL long has
    return t


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


def peak_lr(args):
    """--lr is the LR at a global batch of 256; a batch k times larger gets sqrt(k) times the LR
    with Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms"), or k times with SGD (Goyal et al. 2017, the linear rule). With Adam and a 3-step
    warmup the linear rule diverged here at batch 4096 (README, "Global batch, per-process
    batch, and the LR")."""
    k = args.batch_size / REFERENCE_BATCH
    return args.lr * {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[args.lr_scaling]


def describe_lr(args):
    return (f"LR {args.lr:g} at batch {REFERENCE_BATCH} -> {peak_lr(args):.4g} at "
            f"{args.batch_size} ({LR_RULES[args.lr_scaling]})")


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


# ---------------------------------------------------------------------------------------------
# Checkpoints: plain tensors and primitives only, written atomically by one process.

def checkpoint_state(model, optimizer, scheduler, scaler, epoch, step, args):
    """`epoch` epochs done, plus `step` steps of the next one (0 at an epoch's end)."""
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
# Stopping on SIGTERM: what SLURM, Kubernetes and torchrun send before they kill a job.

class StopSignal:
    """Turns a SIGTERM into a stop at the same step on every process.

    The handler only sets a flag. Every step, each process adds its flag to a one-number
    all-reduce that runs in the background, and reads the sum of the one it started a step
    before: no process waits for another, all read the same sums at the same steps, so all stop
    together, one or two steps after the signal. The sum goes through gloo on the CPU (a gloo
    side group when training uses NCCL), so reading it never waits for the GPU."""

    def __init__(self):
        self.received = self.agreed = False
        self.flag, self.pending, self.group = torch.zeros(1), None, None
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        if self.distributed and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")
        signal.signal(signal.SIGTERM, self._received)

    def _received(self, signum, frame):
        self.received = True

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

    def close(self):
        """Before destroy_process_group: a pending reduction would keep the group alive."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
