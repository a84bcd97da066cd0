"""Everything around the training that is not the lesson: the command line and its checks,
errors as one line, each process's device and threads, where the processes meet when the
script itself must say, and reporting. The lesson never needs to open this file."""
import argparse
import contextlib
import importlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import common
import resumable
from common import Fatal
from resumable import Preempted

# ---- Errors: one line each, never a traceback -----------------------------------------------

# gloo's RuntimeErrors for a peer that died or stopped answering (most name a gloo source file)
GLOO_LOST_PEER = ("/gloo/", "Application timeout caused pair closure", "Wait timeout")
PREEMPTED = 143  # exit code after a SIGTERM: 128 + 15, what shells report for "terminated"


class Failed(Fatal):
    """A process of the job failed (it has said why): one line, exit code 1."""
    code = 1


def say(line):
    """`line` and its newline in one write, so that the lines of processes sharing a pipe (every
    rank's stderr under a launcher) stay whole."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def clean_exit(who=""):
    """Every ending as one line on stderr: exit code 2 for bad input, 1 for a lost peer or an
    error in the code (a bug in the task, CUDA out of memory), whose frames follow its line, 130
    for Ctrl-C, 143 after a SIGTERM. A process that leaves on an error of its own leaves its
    process group first (`leave_group`), so that the others fail at once instead of waiting
    out --timeout. The exit comes outside the `except`, once the failed frames are released."""
    code = None
    try:
        yield
    except Fatal as e:
        if str(e):  # (empty: another process of the job says it)
            say(f"{who}error: {e}")
        code = e.code
    except Preempted as e:
        if str(e):
            say(f"{who}preempted: {e}")
        code = PREEMPTED
    except KeyboardInterrupt:
        say(f"{who}interrupted")
        code = 130
    except Exception as e:
        if isinstance(e, dist.DistError) or (  # a peer died or never came, a port is taken;
                isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_LOST_PEER)):
            line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            line = re.sub(r"^\[\S+\] ", "", line)  # without gloo's "[source.cc:123] "
            say(f"{who}error: distributed: {line[:300]}")  # (gloo: a plain RuntimeError)
            sys.stdout.flush()  # the group is broken: no teardown, where gloo's threads can abort
            os._exit(1)
        frames = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)[1:]))
        say(f"{who}error: {common.reason(e)}\n{frames.rstrip()}")
        code = 1
    if code is not None:
        leave_group()
        sys.exit(code)


def leave_group():
    """Leaves the process group at once. gloo's is destroyed: its connections close, and the
    others' collectives fail. NCCL's is aborted: from 2.6 on, destroy waits for the others'
    work to finish, which a failed process never will, and the abort is given the world group
    by name (2.6's abort of no group aborts the default one's backend and leaves the rest); in
    2.4 and 2.5, which have no abort, destroy aborts (ProcessGroupNCCL::shutdown calls abort)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):  # leaving anyway: the process ends with its own line
        if abort and dist.get_backend() != "gloo":
            abort(dist.group.WORLD)
        else:
            dist.destroy_process_group()


# ---- The command line: one definition, so that a flag means the same in every script; each
# flag's range lives in its type=, so that a bad value is one line before anything starts. ---

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


def gpu_ids(text):
    """--gpus: distinct ids of this machine's GPUs, "0,1" -> [0, 1]."""
    ids = ranged(lambda t: [int(i) for i in t.split(",")], lambda v: all(i >= 0 for i in v),
                 "comma-separated GPU ids")(text)
    gpus = torch.cuda.device_count()
    if len(set(ids)) < len(ids):
        raise argparse.ArgumentTypeError(f"GPU ids must differ, got {text!r}")
    if max(ids) >= gpus:
        raise argparse.ArgumentTypeError(f"got {text!r}, but this machine has {gpus} GPU(s)" + (
            f": ids 0 to {gpus - 1}" if gpus else ""))
    return ids


def parse_args(description, launcher, argv=None):
    """The flags of every script (docs/flags.md), those of `launcher` ("dp": one process;
    "spawn"; "torchrun"; "apex"), then the task's (common.add_task_flags, once --task, read
    first, has been loaded), from `argv` (default: the command line)."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--task")
    load_task(first.parse_known_args(argv)[0].task)
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a, d = p.add_argument, " (default: %(default)s)"
    a("--task", metavar="FILE_OR_MODULE", help="the task to train: a Python file (tasks/text.py) "
      "or a module (mypkg.text) defining the names of docs/your-own-task.md; what it leaves "
      "out is common.py's (default: common.py's, MNIST)")
    a("--epochs", type=positive_int, default=1, help="epochs the LR schedule spans" + d)
    a("--stop-after", type=positive_int, metavar="EPOCH", help="end this run after this epoch, "
      "keeping the schedule of --epochs (continue later with --resume)")
    a("--batch-size", type=positive_int, default=256, help="GLOBAL batch over all processes; "
      "each takes batch-size / world-size" + d)
    a("--accumulate", type=positive_int, default=1, metavar="N", help="N forward and backward "
      "passes (micro-batches) per optimizer step, gradients all-reduced once per step" + d)
    a("--workers", type=natural_int, default=0, metavar="N", help="data-loading processes per "
      "training process; 0 loads in the training process, best for in-memory MNIST" + d)
    a("--lr", type=positive_float, default=0.01, help="peak learning rate at a global batch of "
      f"{common.REFERENCE_BATCH}, scaled to --batch-size by --lr-scaling" + d)
    a("--lr-scaling", choices=list(common.LR_RULES), default="sqrt", help="how the LR follows "
      "the global batch: sqrt (Adam, used here), linear (SGD), none" + d)
    a("--warmup-epochs", type=natural_float, default=0.2, help="linear LR warmup, in epochs, "
      f"at least {common.MIN_WARMUP_STEPS} steps" + d)
    a("--seed", type=ranged(int, lambda v: 0 <= v < 2 ** 63, "an integer 0 to 2**63-1"),
      default=0, help="seed for weights, shuffling, augmentation and dropout" + d)
    a("--amp", choices=["auto", "none", "bf16", "fp16"], default="auto", help="mixed precision: "
      "torch.autocast with this dtype, fp16 with a GradScaler; auto: bf16 where the device "
      "computes it (a GPU from Ampere on; a CPU with AVX512_BF16, AMX or ARM BF16), else none "
      "(fp32)" + d)
    a("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (CUDA only)")
    a("--channels-last", action=argparse.BooleanOptionalAction, default=False, help="the model "
      "and 4-D input batches in channels_last (NHWC) memory format: faster convolutions "
      "(docs/speed.md); the task's default (MNIST's: on; --no-channels-last: off)")
    a("--compile", action="store_true", help="torch.compile the DDP-wrapped model")
    a("--checkpoint", metavar="PATH", help="written by one process after every epoch; with it, "
      "a SIGTERM stops every process at the same step and saves there")
    a("--save-every", type=natural_int, default=0, metavar="STEPS", help="also write "
      "--checkpoint every this many steps; a resume continues from that step" + d)
    a("--resume", action="store_true", help="continue from --checkpoint")
    a("--evaluate", action="store_true", help="evaluate the model in --checkpoint and exit")
    a("--metrics", metavar="PATH", help="append one JSON object per epoch (rank 0)")
    a("--log-interval", type=positive_int, default=50, metavar="STEPS",
      help="progress line every this many steps" + d)
    if launcher == "dp":
        a("--gpus", type=gpu_ids, help="GPU ids, e.g. 0,1 (default: all)")
        p.set_defaults(save_on_each_node=False, timeout=None, join_timeout=None)
    else:
        a("--save-on-each-node", action="store_true", help="one checkpoint writer per node "
          "(local rank 0), for nodes without a shared filesystem")
        a("--timeout", type=positive_float, default=600, metavar="SECONDS", help="how long a "
          "collective waits for the slowest process, e.g. one writing a checkpoint" + d)
        a("--join-timeout", type=positive_float, default=60, metavar="SECONDS", help="how long "
          "the processes wait for each other at start-up" + d)
    if launcher == "spawn":
        g = p.add_argument_group("launch (spawn)").add_argument
        g("--nproc-per-node", type=positive_int, help="processes on this machine (default: one "
          "per GPU, or 2 without a GPU)")
        g("--nnodes", type=positive_int, default=1, help="machines" + d)
        g("--node-rank", type=natural_int, default=0, help="this machine's index")
        g("--master-addr", help="node 0's address, reachable from every node")
        g("--master-port", type=ranged(int, lambda v: 0 < v < 65536, "a port number 1-65535"),
          help="a free port on node 0 (one machine without it: a private file, no port)")
    if launcher in ("torchrun", "apex"):
        g = p.add_argument_group(f"launch (torchrun){' and apex' * (launcher == 'apex')}")
        g.add_argument("--local-rank", "--local_rank", type=natural_int, default=0, help="passed "
                       "by python -m torch.distributed.launch; LOCAL_RANK in the environment wins")
    if launcher == "apex":
        g.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1", help="apex "
                       "amp opt level; natively O0 is fp32, the others autocast (docs/apex.md)" + d)
        g.add_argument("--native", action="store_true", help="the native path even if apex works")
    common.add_task_flags(p)  # last: a task may also change the defaults above (set_defaults)
    args = p.parse_args(argv)
    args.task = args.task and os.path.normpath(args.task)  # as compared by a resume
    if launcher == "dp" and args.gpus is None:
        args.gpus = list(range(torch.cuda.device_count()))
    if launcher == "spawn" and args.nproc_per_node is None:  # one process per GPU
        args.nproc_per_node = torch.cuda.device_count() or 2
    return args


SEAM = ("add_task_flags", "prepare_data", "make_datasets", "collate", "make_model", "loss_fn",
        "make_optimizer", "make_scheduler", "evaluate_batch", "summarize")  # your-own-task.md


def load_task(task):
    """--task: a Python file or an importable module whose names of the seam (SEAM) replace
    common.py's, where the scripts look them up when they call them; what it leaves out stays
    common.py's. A file is imported under its own name with its folder on the path, so that
    processes started by spawn import it by that name too. (A checkpoint names its task only to
    be compared: no code is ever imported because a file says so, docs/security.md.)"""
    if not task:
        return
    name = task
    if task.endswith(".py") or os.sep in task or "/" in task:
        if not os.path.isfile(task):
            raise Fatal(f"--task {task}: no such file")
        folder, name = os.path.split(os.path.abspath(task)[:-len(".py")])
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # a module the task imports is missing: its own line and frames
        raise Fatal(f"--task {task}: no module named {e.name}") from None
    for seam in SEAM:
        if hasattr(module, seam):
            setattr(common, seam, getattr(module, seam))


def check_args(args, elastic=False, cuda=None):
    """Refuse what cannot work, in the launching process before anything starts, and make sure
    every file this node will write can be written. `elastic`: started by torchrun (its
    environment says who is who); the script then resumes whenever it finds --checkpoint.
    `cuda`: whether it trains on CUDA (default: where there is a GPU)."""
    gpus, dp = torch.cuda.device_count(), args.timeout is None
    cuda = gpus > 0 if cuda is None else cuda
    nnodes, node_rank = getattr(args, "nnodes", 1), getattr(args, "node_rank", 0)
    local = getattr(args, "nproc_per_node", 1)
    world_size, notes = nnodes * local, True
    gpu = (getattr(args, "gpus", None) or [0])[0]  # the GPU this process, or its first, uses
    if elastic:  # torchrun's environment; without one, one process
        local, world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get(
            "WORLD_SIZE", 1))
        node_rank = int(os.environ.get("GROUP_RANK", 0))  # its node 0 holds global rank 0
        gpu = int(os.environ.get("LOCAL_RANK", args.local_rank))
        notes = gpu == 0
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if elastic and tasks > 1 and "RANK" not in os.environ:  # srun python torchrun_ddp.py
        raise Fatal(f"srun started {tasks} tasks of this script without torchrun, and each would "
                    "train alone: run torchrun on each node (srun --ntasks-per-node=1 torchrun "
                    "..., as slurm/torchrun_ddp.sbatch does), or spawn_ddp.py")
    if gpus and local > gpus:  # two processes on one GPU: NCCL refuses, or they fight
        raise Fatal(f"--nproc-per-node {local} but this machine has {gpus} GPU(s)")
    if dp and (args.sync_bn or args.compile):
        raise Fatal(f"--{'sync-bn' if args.sync_bn else 'compile'} needs the DDP scripts "
                    "(spawn_ddp.py): SyncBatchNorm needs a process group, and PyTorch documents "
                    "torch.compile with DDP, not with DataParallel")
    if nnodes > 1 and not (args.master_addr and args.master_port):
        raise Fatal("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if node_rank >= nnodes and not elastic:
        raise Fatal(f"--node-rank must be in 0..{nnodes - 1}")
    for flag, path in (("--checkpoint", args.checkpoint), ("--metrics", args.metrics)):
        if path and os.path.isdir(path):
            raise Fatal(f"{flag} {path} is a folder; give a file path")
    if args.batch_size % (world_size * args.accumulate) and not args.evaluate:
        raise Fatal(f"--batch-size {args.batch_size} is the global batch " + (
            f"and must divide by the world size {world_size}" if args.batch_size % world_size
            else f"of one optimizer step and must divide by world size x --accumulate = "
            f"{world_size} x {args.accumulate}"))
    if args.stop_after is not None and args.stop_after > args.epochs:
        raise Fatal(f"--stop-after {args.stop_after} is past --epochs {args.epochs}")
    if args.warmup_epochs >= args.epochs:
        raise Fatal(f"--warmup-epochs {args.warmup_epochs:g} must be shorter than --epochs "
                    f"{args.epochs}")
    if args.sync_bn and not cuda:
        raise Fatal("--sync-bn needs CUDA: nn.SyncBatchNorm does not train on CPU")
    if not dp and not gpus and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # DDP's constructor reads the gloo group's thread count from DETAIL's wrapper as if it
        # were the group: a read of the wrong object, which crashes or not (troubleshooting.md)
        raise Fatal("TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch's DDP read invalid memory on gloo "
                    "(CPU), and crash or not; use INFO (docs/troubleshooting.md)")
    if args.compile and not cuda and not shutil.which(os.environ.get("CXX", "g++")):
        raise Fatal("--compile on a CPU needs a C++ compiler for inductor: none runs as $CXX or "
                    "g++; install g++ or point CXX to one")  # else a traceback at the first step
    if (args.resume or args.evaluate or args.save_every) and not args.checkpoint:
        raise Fatal("--resume, --evaluate and --save-every need --checkpoint PATH")
    writes = node_rank == 0 or args.save_on_each_node  # this node writes --checkpoint
    if not (args.evaluate or args.resume or elastic) and writes and args.checkpoint \
            and os.path.exists(args.checkpoint):  # (torchrun's resume it, if it is their run's)
        raise Fatal(f"--checkpoint {args.checkpoint} exists: add --resume to continue its run, "
                    "or give another path to start a new one")
    if (args.evaluate or args.resume) and local == world_size and not os.path.exists(
            args.checkpoint):  # on one machine it must be here (elsewhere: another node's)
        raise Fatal(f"no checkpoint at {args.checkpoint}")
    if (args.evaluate or args.resume) and not elastic and os.path.isfile(args.checkpoint):
        # a bad checkpoint fails here once, not in every process (torchrun's each check theirs)
        with torch.device("meta"):  # shapes only: no memory for the model, no data read
            model = common.make_model(args)
        ckpt = common.load_checkpoint(args.checkpoint)
        if not args.evaluate:  # another run's checkpoint, refused before any process starts
            resumable.check_same_run(args, ckpt, args.checkpoint)
        resumable.load_model_state(model, ckpt["model"], args.checkpoint, assign=True)
    gpu = gpu if cuda else None  # the device whose precision counts: that GPU, or the CPU
    if notes:  # --amp auto: settle_precision decides, once the job has met
        warn_if_slower(args.amp, gpu)
    if getattr(args, "master_port", None) and node_rank == 0:  # node 0 hosts the store there
        with socket.socket() as s:  # SO_REUSEADDR, as the store: a run that just ended (its
            if os.name != "nt":  # connections in TIME_WAIT) leaves the port free; on Windows
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # it shares ports
            try:
                s.bind(("", args.master_port))
            except OSError:
                raise Fatal(f"port {args.master_port} is already in use on this machine; choose "
                            "another --master-port") from None
    outputs = [("--metrics", args.metrics)] if node_rank == 0 else []
    if not args.evaluate and writes:
        outputs.append(("--checkpoint", args.checkpoint))
    for flag, path in [(f, p) for f, p in outputs if p]:  # created (and said) or refused now
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder)
            if notes:
                print(f"created folder {folder} for {flag}", flush=True)
        except FileExistsError:
            pass
        except OSError as e:
            raise Fatal(f"{flag} {path}: cannot create the folder {folder} ({e.strerror})") \
                from None
        try:
            tempfile.TemporaryFile(dir=folder).close()
            if os.path.exists(path) and not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise Fatal(f"{flag} {path}: cannot write in {folder} ({e.strerror})") from None


def check_task(model, loader, test_loader, device, world_size, channels_last=False):
    """A task that does not fit the scripts (docs/your-own-task.md) fails here, before the first
    step, in one line that names the part that failed, with the task's own frames under it. In
    every process its first training batch goes through collate, the model in train mode and
    loss_fn, and its first test batch through the model, evaluate_batch and summarize; warnings
    in the task's own arithmetic (loss_fn, evaluate_batch, summarize) are raised as errors: a
    loss whose output and target only broadcast to each other warns, where a model's forward
    may warn of nothing wrong (a library's notices). It leaves no trace: the model's buffers
    and the random generators are restored."""
    if len(test_loader.dataset) < world_size:
        raise Fatal(f"the test set has {len(test_loader.dataset)} samples, fewer than the "
                    f"{world_size} processes: each must evaluate at least one")
    buffers, training = [b.clone() for b in model.buffers()], model.training
    rng = random.getstate()  # torch's generators: fork_rng below
    step, output, target = "the dataset", None, None
    try:
        with torch.no_grad(), torch.random.fork_rng([device] if device.type == "cuda" else []):
            for batches, train in ((loader, True), (test_loader, False)):
                data = batches.dataset  # what the DataLoader's worker would do with a batch:
                indices = next(iter(batches.batch_sampler))
                step, output = "the dataset", None
                samples = data.__getitems__(indices) if callable(
                    getattr(data, "__getitems__", None)) else [data[i] for i in indices]
                step = "collate(samples)"
                inputs, target = common.collate(samples)
                step = "the model's forward"
                model.train(train)
                output = common.forward(model, common.to_device(inputs, device, channels_last))
                target = target.to(device)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    if train:
                        step = "loss_fn(output, target)"
                        loss = common.loss_fn(output, target)
                        if torch.as_tensor(loss).numel() != 1:
                            raise ValueError(f"it returned a tensor of shape "
                                             f"{list(loss.shape)}, not one number")
                        continue
                    step = "evaluate_batch(output, target)"
                    sums = {k: float(v) for k, v in common.evaluate_batch(output, target).items()}
                    step = "summarize(sums)"
                    {k: float(v) for k, v in common.summarize(sums).items()}
    except Exception as e:
        shapes = ""
        if step.startswith("loss_fn") and torch.is_tensor(output) and torch.is_tensor(target) \
                and output.shape != target.shape:
            with contextlib.suppress(RuntimeError):
                torch.broadcast_shapes(output.shape, target.shape)
                shapes = f"; output {list(output.shape)} and target {list(target.shape)} only " \
                         "broadcast to each other"
        frames = task_frames(e.__traceback__)
        raise Fatal(f"the task does not fit the scripts: {step} raised {common.reason(e)}"
                    f"{shapes} (docs/your-own-task.md)"
                    + f"\n{frames}" * bool(frames)) from None
    finally:
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
        model.train(training)
        random.setstate(rng)


def task_frames(tb):
    """The frames of a traceback in the files that define the task's names (a --task file, or
    common.py), less common.py's helpers that check_task calls; as Python prints them, without
    the header."""
    files = {fn.__code__.co_filename for fn in (getattr(common, name) for name in SEAM)
             if hasattr(fn, "__code__")}
    helpers = {common.forward.__code__, common.to_device.__code__}
    kept = [(frame, line) for frame, line in traceback.walk_tb(tb)
            if frame.f_code.co_filename in files and frame.f_code not in helpers]
    return "".join(traceback.StackSummary.extract(kept).format()).rstrip()


# ---- The machine: devices, cores, precision. Portable: Linux, macOS, Windows. ----------------

def process_device(local_rank, local_world_size):
    """This process's device: its own GPU, made current (so that NCCL and every .cuda() use it),
    or the CPU with its share of the cores, which processes on one machine otherwise fight over
    (pytorch/pytorch#22260); OMP_NUM_THREADS, if set, wins."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cpu_count() // local_world_size))
    elif not os.environ["OMP_NUM_THREADS"].isdigit() or int(os.environ["OMP_NUM_THREADS"]) < 1:
        raise Fatal(f"OMP_NUM_THREADS: expected an integer > 0, got "
                    f"{os.environ['OMP_NUM_THREADS']!r}")
    return torch.device("cpu")


def cpu_count():
    """Cores this process may use: Linux's affinity mask (containers, taskset, SLURM), or all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


BF16_CPU = {"avx512_bf16": "AVX512_BF16", "amx_bf16": "AMX", "bf16": "BF16", "sve_bf16": "SVE BF16"}
PRECISION = {"bf16": "bf16 autocast", "fp16": "fp16 autocast with a GradScaler", "none": "fp32"}


def computes_bf16(gpu):
    """(whether the device computes bfloat16, what it has or lacks, in words) for GPU number
    `gpu`, asked by index (not the current device: GPU 0 before set_device), or for the CPU
    (None), where autocast emulates bf16, slower than fp32, without AVX512_BF16 or AMX (x86) or
    BF16 (ARM). None for a CPU this torch cannot tell about (2.4: no get_capabilities)."""
    if gpu is not None:
        name = torch.cuda.get_device_name(gpu)
        if torch.cuda.get_device_capability(gpu) >= (8, 0):  # Ampere on
            return True, f"the {name} computes bfloat16"
        return False, f"the {name} has no bfloat16 arithmetic (Ampere and later have)"
    caps = getattr(torch.cpu, "get_capabilities", dict)()
    found = [name for key, name in BF16_CPU.items() if caps.get(key)]
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    if not caps:
        return None, f"torch {torch.__version__} cannot tell whether this CPU has bfloat16 " \
                     "instructions"
    return False, "this CPU has no bfloat16 instructions (AVX512_BF16, AMX or ARM BF16)"


class Autocast(torch.nn.Module):
    """The model's forward under autocast with the job's dtype. DataParallel runs each replica
    in a thread of its own, which enters autocast without a dtype (float16 on a GPU): the dtype
    a thread chose does not reach another (pytorch/pytorch torch/nn/parallel/parallel_apply.py)."""

    def __init__(self, model, dtype, device_type="cuda"):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.model(*args, **kwargs)


def settle_precision(args, ckpt, device, log=print):
    """--amp auto, decided once for the whole job, after the process group formed, and said
    once: a resumed run keeps the precision it was trained in (the checkpoint's); a new one is
    bf16 only if every process's device computes bfloat16, else fp32. (Each deciding alone, the
    ranks of one job on GPUs of two generations would train in two precisions.)"""
    if args.amp != "auto" or args.evaluate:
        return
    gpu = device.index if device.type == "cuda" else None
    if ckpt:
        args.amp = ckpt["args"].get("amp", "none")
        log(f"precision: {PRECISION[args.amp]}, the precision the checkpoint was trained in "
            "(--amp auto)")
        warn_if_slower(args.amp, gpu)
        return
    fast, why = computes_bf16(gpu)
    args.amp = "bf16" if fast else "none"
    if dist.is_initialized():  # the least capable device decides
        mine = torch.tensor([args.amp == "bf16"], dtype=torch.uint8, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        common.recent.extend([mine, *every])
        dist.all_gather(every, mine)
        lacking = [str(r) for r, f in enumerate(torch.cat(every).tolist()) if not f]  # 1 wait
        if lacking and args.amp == "bf16":
            args.amp, why = "none", f"the device of rank(s) {', '.join(lacking)} has no " \
                                    "bfloat16 arithmetic and all train in one precision"
    log(f"precision: {PRECISION[args.amp]}, as {why} (--amp auto; --amp none: fp32)")


def warn_if_slower(amp, gpu):
    """A warning line where --amp `amp` runs slower than fp32 on GPU number `gpu` (None: CPU)."""
    fast, why = computes_bf16(gpu) if amp == "bf16" else (None, "")
    if amp == "fp16" and gpu is None:
        fast, why = False, "float16 autocast on a CPU ran many times slower (docs/training.md)"
    if fast is False:
        say(f"warning: --amp {amp} on this {'CPU' if gpu is None else 'GPU'} is slower than "
            f"fp32: {why}{', so bf16 is emulated' * (amp == 'bf16')}"
            f"{'; use fp16' * (gpu is not None)}")


# ---- Where the processes meet, where the script itself says -----------------------------------

def on_loopback():
    """All processes on this machine: gloo's and NCCL's sockets on loopback, where no other
    machine reaches them (they would listen where the host name resolves, on a laptop perhaps
    nowhere: pytorch/pytorch#26049). Variables the user set win. docs/security.md."""
    with contextlib.suppress(AttributeError, OSError):
        names = [name for _, name in socket.if_nameindex()]
        lo = next((n for n in names if n.startswith("lo")), None)
        if lo:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def spawn_store(args, store_file, rank, device):
    """Where spawn_ddp.py's processes meet. One machine: a file in the launcher's private folder
    (no port). Several, or --master-port: a TCP store that rank 0 hosts on node 0 (on every
    interface: docs/security.md), in which the nodes first check that all run as many processes.
    Then all meet (`meet`)."""
    nproc = args.nproc_per_node
    where = (args.node_rank, rank % nproc == 0, backend(device))
    if args.master_port is None:
        on_loopback()
        return meet(dist.FileStore(store_file, args.nnodes * nproc), rank, args.nnodes * nproc,
                    args, *where)
    store = dist.TCPStore(args.master_addr or "127.0.0.1", args.master_port, is_master=rank == 0,
                          timeout=timedelta(seconds=args.join_timeout))
    store.set(f"nproc/{args.node_rank}", str(nproc))
    counts = [int(store.get(f"nproc/{n}")) for n in range(args.nnodes)]
    if len(set(counts)) > 1:  # their ranks would collide
        read_by_all(store, "nproc/read", rank, sum(counts), args.join_timeout)
        raise Fatal(f"every node must run the same --nproc-per-node; nodes 0..{args.nnodes - 1} "
                    f"run {', '.join(map(str, counts))}")
    return meet(store, rank, args.nnodes * nproc, args, *where)


def torchrun_store(args, world_size, nproc, device):
    """The store that init_process_group would make from torchrun's environment (MASTER_ADDR,
    MASTER_PORT), after the meeting (`meet`), under the prefix of this round. Without
    torchrun: one in memory."""
    if nproc == world_size:
        on_loopback()
    if "RANK" not in os.environ:
        return dist.HashStore()
    store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=args.join_timeout)))
    node, local_rank = int(os.environ.get("GROUP_RANK", 0)), int(os.environ["LOCAL_RANK"])
    return meet(store, rank, world_size, args, node, local_rank == 0, backend(device))


def backend(device):
    """The process group's backend on `device`, and the device's type, in words."""
    return f"{'nccl' if device.type == 'cuda' else 'gloo'} on {device.type}"


def meet(store, rank, world_size, args, node, first_on_node, kind):
    """Every process checks in and waits for all, in a round that rank 0 opens under a new token:
    torchrun's agent keeps its store from round to round (pytorch/pytorch#167288), so the last
    round's keys are still there, and TORCHELASTIC_RESTART_COUNT, which counts per node, cannot
    tell the rounds apart (a replaced node starts at 0). A token whose round is over is an
    earlier round's, and so is one whose round never formed: the process looks again until rank
    0's new one is there. --join-timeout bounds the wait for one that never comes, and names it.
    Rank 0 then compares what each would train on (`kind`): a node whose processes would use
    another backend (a GPU not seen: gloo on the CPU beside NCCL) is refused, said once per
    node. Returns the store under the round's prefix, waiting --timeout: init_process_group
    keeps the timeout of a store it is given (only its init_method path sets it), and NCCL
    fetches its unique id through that store inside the call, where a node still preparing its
    data would otherwise fail the start-up."""
    store.set_timeout(timedelta(seconds=args.join_timeout))
    deadline, token = time.monotonic() + args.join_timeout, None
    try:
        if rank == 0:
            token = secrets.token_hex(8)
            store.set("round", token)
            store.set(f"{token}/0", f"{node} {kind}")
            store.wait([f"{token}/{r}" for r in range(world_size)])
            others = [store.get(f"{token}/{r}").decode().split(" ", 1) for r in range(world_size)]
            odd = sorted({int(n) for n, k in others if k != kind})
            verdict = f"the processes of node(s) {', '.join(map(str, odd))} would train with " \
                f"{next(k for n, k in others if k != kind)}, rank 0 with {kind}: every node " \
                "must see its GPUs (check its driver with nvidia-smi)" if odd else ""
            store.set(f"{token}/all", verdict)
        pause = 0.01  # (polled: a TCPStore client whose wait timed out answers out of turn)
        while rank != 0:
            seen = store.get("round").decode()
            if store.check([f"{seen}/all"]):  # a round that is over: ours, or the last one's
                if seen == token:
                    break
            elif seen != token:
                token = seen
                store.set(f"{token}/{rank}", f"{node} {kind}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError("")
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        if rank != 0:
            verdict = store.get(f"{token}/all").decode()
        if verdict:
            read_by_all(store, f"{token}/read", rank, world_size, args.join_timeout)
            raise Fatal(verdict if first_on_node else "")
    except RuntimeError as e:  # a store that waited --join-timeout (a FileStore's: not a DistError)
        if not isinstance(e, dist.DistError) and "imeout" not in str(e):
            raise
        missing = [str(r) for r in range(world_size)
                   if not store.check([f"{token}/{r}"])] if token else ["0"]
        raise dist.DistStoreError(f"rank(s) {', '.join(missing) or '?'} did not come within "
                                  f"--join-timeout {args.join_timeout:g} s") from None
    store = dist.PrefixStore(f"{token}/", store)
    store.set_timeout(timedelta(seconds=args.timeout))
    return store


def read_by_all(store, key, rank, world_size, seconds):
    """Before a refusal read from the store: each process counts itself at `key`, and rank 0,
    which hosts the store on several nodes, leaves only once all have read (`seconds` at most)."""
    store.add(key, 1)
    deadline = time.monotonic() + seconds
    while rank == 0 and store.add(key, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def worker(local_rank, train, args, private):
    """mp.spawn's target: train(local_rank, args, the store's file in the launcher's private
    folder), an error as one line that names the rank."""
    with clean_exit(f"[rank {args.node_rank * args.nproc_per_node + local_rank}] "):
        # NCCL: a collective that fails or times out takes its process down, as under torchrun
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        load_task(args.task)  # a new interpreter: common.py's names again, until the task's
        train(local_rank, args, os.path.join(private, "store"))


def join(workers):
    """spawn_ddp.py's launcher: wait for its processes; a SIGTERM to it alone (`kill PID`) goes on
    to them, and none outlives it."""
    signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in workers.processes])
    try:
        while not workers.join():
            pass
    except torch.multiprocessing.ProcessExitedException as e:  # it has said why
        raise Preempted() if e.exit_code == PREEMPTED else Failed(
            f"worker {e.error_index} exited with code {e.exit_code}") from None
    finally:  # Ctrl-C, or a failure
        [p.terminate() for p in workers.processes if p.is_alive()]


# ---- Reporting: the console and --metrics, from rank 0 only ----------------------------------

class Reporter:
    def __init__(self, args, rank, world_size, device):
        self.on, self.args, self.world_size = rank == 0, args, world_size
        nodes = getattr(args, "nnodes", 0) or world_size // int(os.environ.get(
            "LOCAL_WORLD_SIZE", world_size))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self.log(f"{world_size} processes ({nodes} node(s) x {world_size // nodes})"
                 f"{f', backend {dist.get_backend()}' if dist.is_initialized() else ''}, device "
                 f"{device.type}, {torch.get_num_threads()} thread(s) each"
                 f"{f', restart {restart} (TORCHELASTIC_RESTART_COUNT)' if restart else ''}")
        if getattr(args, "gpus", None) and device.type == "cuda":  # dp_baseline.py
            self.log(f"DataParallel over GPU(s) {args.gpus}, gathering on {device}")
        self.log(f"task {args.task or 'common.py'}")
        self.log(f"LR {args.lr:g} at batch {common.REFERENCE_BATCH} -> {common.peak_lr(args):.4g} "
                 f"at {args.batch_size} ({common.LR_RULES[args.lr_scaling]})")

    def log(self, msg):
        if self.on:
            print(msg, flush=True)

    def progress(self, epoch, step, steps, loss, lr, stats):
        rate = stats.seen * self.world_size / max(time.perf_counter() - stats.start, 1e-9)
        self.log(f"epoch {epoch + 1}/{self.args.epochs} step {step}/{steps} loss {loss:.4f} "
                 f"lr {lr:.3g} {rate:.0f} samples/s")

    def record(self, **fields):
        """One epoch (or an evaluation): a line on the console, a JSON line in --metrics."""
        fields["world_size"] = self.world_size
        self.log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in fields.items()))
        if self.on and self.args.metrics:
            with open(self.args.metrics, "a") as f:
                f.write(json.dumps(fields) + "\n")


class EpochStats:
    """One epoch of one process: its loss summed on the device (no sync per step), the samples
    it trained, its seconds (after the GPU's queued work) and the time it waited for batches;
    an epoch resumed after `skipped` of its `steps` says that it covers only the rest."""

    def __init__(self, device, skipped=0, steps=0):
        self.device, self.seen, self.data_wait = device, 0, 0.0
        self.skipped, self.steps = skipped, steps
        self.loss_sum, self.start = torch.zeros((), device=device), self.now()

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timed(self, loader):
        """The loader's batches, adding up how long the loop waits for each."""
        batches, start = iter(loader), time.perf_counter()
        for batch in batches:
            self.data_wait += time.perf_counter() - start
            yield batch
            start = time.perf_counter()

    def add(self, loss, n):
        self.loss_sum += loss.detach() * n
        self.seen += n

    def speed(self, world_size):
        """The epoch's seconds, samples per second over all processes, the share spent waiting."""
        seconds = self.now() - self.start
        partial = {"partial": f"steps {self.skipped + 1}-{self.steps} of {self.steps} (resumed)"}
        return {"epoch_seconds": seconds, "samples_per_s": self.seen * world_size / seconds,
                "data_wait": self.data_wait / seconds, **(partial if self.skipped else {})}
