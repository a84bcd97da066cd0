"""The command line, defined once so that a flag means the same in every script, and its
checks: each flag's range in its type=, and what cannot work refused in check_args, in one line
before anything starts (docs/flags.md)."""
import argparse
import math
import os
import shutil
import socket
import tempfile

import torch
import torch.distributed as dist

import common
from common import Fatal

from . import checkpoint, launch, machine
from .task import load_task


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
    "spawn"; "torchrun"; "fsdp"; "apex"), then the task's (common.add_task_flags, once --task, read
    first, has been loaded), from `argv` (default: the command line)."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--task")
    task = load_task(first.parse_known_args(argv)[0].task)
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
    a("--deterministic", action="store_true", help="the same result every run on a GPU too: "
      "deterministic algorithms only, cuDNN's included, no cudnn.benchmark; slower "
      "(docs/training.md)")
    a("--checkpoint", metavar="PATH", help="written by one process after every epoch; with it, "
      "a SIGTERM stops every process at the same step and saves there")
    a("--save-every", type=natural_int, default=0, metavar="STEPS", help="also write "
      "--checkpoint every this many steps; a resume continues from that step" + d)
    a("--resume", action="store_true", help="continue from --checkpoint")
    a("--evaluate", action="store_true", help="evaluate the model in --checkpoint and exit")
    a("--metrics", metavar="PATH", help="append one JSON object per epoch (rank 0)")
    a("--tensorboard", metavar="DIR", help="also write the progress lines' and --metrics' "
      "numbers as TensorBoard curves in DIR (rank 0); a resumed run continues them (needs "
      "pip install tensorboard; view: tensorboard --logdir DIR)")
    a("--log-interval", type=positive_int, default=50, metavar="STEPS",
      help="progress line every this many steps" + d)
    if launcher == "dp":
        a("--gpus", type=gpu_ids, default=list(range(torch.cuda.device_count())),
          help="GPU ids, e.g. 0,1 (default: all)")
        p.set_defaults(save_on_each_node=False, timeout=None, join_timeout=None,
                       step_timeout=None)
    else:
        a("--save-on-each-node", action="store_true", help="one checkpoint writer per node "
          "(local rank 0), for nodes without a shared filesystem")
        a("--timeout", type=positive_float, default=600, metavar="SECONDS", help="how long a "
          "collective waits for the slowest process at start-up, in the first step and around "
          "a checkpoint write" + d)
        a("--step-timeout", type=positive_float, default=120, metavar="SECONDS", help="the "
          "same after each training step, where a lost peer should end the job soon" + d)
        a("--join-timeout", type=positive_float, default=600, metavar="SECONDS", help="how long "
          "the processes wait for each other at start-up (torchrun's rendezvous: 600 s)" + d)
    if launcher in ("spawn", "torchrun", "apex"):  # DDP's; FSDP2 and DataParallel need none
        a("--find-unused-parameters", action="store_true", help="DDP: a model whose forward "
          "leaves parameters without a gradient (a branch it skips, a frozen head) trains; DDP "
          "then walks the autograd graph each step (docs/troubleshooting.md)")
    if launcher == "spawn":
        g = p.add_argument_group("launch (spawn)").add_argument
        g("--nproc-per-node", type=positive_int, default=torch.cuda.device_count() or 2,
          help="processes on this machine (default: one per GPU, or 2 without a GPU)")
        g("--nnodes", type=positive_int, default=1, help="machines" + d)
        g("--node-rank", type=natural_int, default=0, help="this machine's index")
        g("--master-addr", help="node 0's address, reachable from every node")
        g("--master-port", type=ranged(int, lambda v: 0 < v < 65536, "a port number 1-65535"),
          help="a free port on node 0 (one machine without it: a private file, no port)")
    if launcher in ("torchrun", "fsdp", "apex"):
        g = p.add_argument_group(f"launch (torchrun){' and apex' * (launcher == 'apex')}")
        g.add_argument("--local-rank", "--local_rank", type=natural_int, default=0, help="passed "
                       "by python -m torch.distributed.launch, which also sets LOCAL_RANK: the one "
                       "read")
    if launcher == "apex":
        g.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1", help="apex "
                       "amp opt level; natively O0 is fp32, the others autocast (docs/apex.md)" + d)
        g.add_argument("--native", action="store_true", help="the native path even if apex works")
    task.add_task_flags(p)  # last: a task may also change the defaults above (set_defaults)
    args = p.parse_args(argv)
    args.task = args.task and os.path.normpath(args.task)  # as compared by a resume
    # One spelling: a shell completes a link to a folder with "/" (and islink("snap/") follows
    # it), so "snap/", "./snap" and "snap" must be one checkpoint.
    args.checkpoint = args.checkpoint and os.path.normpath(args.checkpoint)
    machine.deterministic(args.deterministic)  # every process that parses: before CUDA work
    return args


def check_args(args, task, place=None, elastic=False, cuda=None, sharded=False):
    """Refuse what cannot work before anything starts, and make sure every file this node will
    write can be written: in each node's launcher (`place`: its first process), or in each
    process under torchrun (`elastic`: it resumes whenever it finds --checkpoint). `task`: the
    one the checkpoint must fit. `cuda`: whether it trains on CUDA (default: with a GPU).
    `sharded`: torchrun_fsdp.py's, whose checkpoint is a folder."""
    spawns = hasattr(args, "nnodes")  # spawn_ddp.py's launcher, checking for its processes
    if place is None:
        place = launch.spawn_place(args, 0) if spawns else launch.Place()
    gpus, dp = torch.cuda.device_count(), args.timeout is None
    cuda = gpus > 0 if cuda is None else cuda
    nnodes, node_rank = getattr(args, "nnodes", 1), getattr(args, "node_rank", 0)  # spawn's
    gpu = (getattr(args, "gpus", None) or [place.local_rank])[0]  # its GPU, or its first
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if elastic and tasks > 1 and not place.who:  # srun python torchrun_ddp.py: no launcher
        raise Fatal(f"srun started {tasks} tasks of this script without torchrun, and each would "
                    "train alone: run torchrun on each node (srun --ntasks-per-node=1 torchrun "
                    "..., as slurm/torchrun_ddp.sbatch does), or spawn_ddp.py")
    if gpus and place.nproc > gpus:  # two processes on one GPU: NCCL refuses, or they fight
        raise Fatal(f"--nproc-per-node {place.nproc} but this machine has {gpus} GPU(s)")
    if dp and (args.sync_bn or args.compile):
        raise Fatal(f"--{'sync-bn' if args.sync_bn else 'compile'} needs the DDP scripts "
                    "(spawn_ddp.py): SyncBatchNorm needs a process group, and PyTorch documents "
                    "torch.compile with DDP, not with DataParallel")
    if nnodes > 1 and not (args.master_addr and args.master_port):
        raise Fatal("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if node_rank >= nnodes:
        raise Fatal(f"--node-rank must be in 0..{nnodes - 1}")
    if sharded and torch.__version__ < (2, 6 if cuda else 7):
        raise Fatal(f"torchrun_fsdp.py needs torch {'2.6' if cuda else '2.7'} or later (FSDP2 "
                    f"{'on CUDA' if cuda else 'on a CPU'}); this is torch {torch.__version__}")
    if sharded and args.save_on_each_node:
        raise Fatal("--save-on-each-node: torchrun_fsdp.py's checkpoint is one folder that all "
                    "processes write their shards to, on a filesystem every node shares")
    if args.tensorboard:  # optional: the scripts need only torch and torchvision
        try:
            import tensorboard  # noqa: F401 (the package alone: 1 ms; its writer on rank 0)
        except ImportError:
            raise Fatal("--tensorboard needs the tensorboard package: pip install tensorboard") \
                from None
    for flag, path, folder in (("--checkpoint", args.checkpoint, sharded),
                               ("--metrics", args.metrics, False),
                               ("--tensorboard", args.tensorboard, True)):
        if path and os.path.exists(path) and os.path.isdir(path) != folder:
            kinds = ("file", "folder") if folder else ("folder", "file")
            raise Fatal(f"{flag} {path} is a {kinds[0]}; give a {kinds[1]} path")
    if args.batch_size % (place.world_size * args.accumulate) and not args.evaluate:
        raise Fatal(f"--batch-size {args.batch_size} is the global batch " + (
            f"and must divide by the world size {place.world_size}"
            if args.batch_size % place.world_size else f"of one optimizer step and must divide "
            f"by world size x --accumulate = {place.world_size} x {args.accumulate}"))
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
    writes = place.node == 0 or args.save_on_each_node  # this node writes --checkpoint
    if not (args.evaluate or args.resume or elastic) and writes and args.checkpoint \
            and os.path.exists(args.checkpoint):  # (torchrun's resume it, if it is their run's)
        raise Fatal(f"--checkpoint {args.checkpoint} exists: add --resume to continue its run, "
                    "or give another path to start a new one")
    model = None
    if sharded:  # FSDP: every process of a machine builds the whole model before sharding it
        with torch.device("meta"):  # its shapes, no memory: for this check and check_file's
            model = task.make_model(args)
        machine.check_host_memory(model, place.nproc)
    if args.checkpoint and (args.evaluate or args.resume or elastic):
        checkpoint.check_file(args, task, place,  # it is this run's, and fits the model; a
                              keep=not spawns, model=model)  # process that trains keeps it
    if place.local_rank == 0:  # --amp auto: decided once the job has met (checkpoint.agreed)
        machine.warn_if_slower(args.amp, gpu if cuda else None)
    if getattr(args, "master_port", None) and node_rank == 0:  # node 0 hosts the store there
        with socket.socket() as s:  # SO_REUSEADDR, as the store: a run that just ended (its
            if os.name != "nt":  # connections in TIME_WAIT) leaves the port free; on Windows
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # it shares ports
            try:
                s.bind(("", args.master_port))
            except OSError:
                raise Fatal(f"port {args.master_port} is already in use on this machine; choose "
                            "another --master-port") from None
    outputs = [("--metrics", args.metrics)] if place.node == 0 else []
    if not args.evaluate and place.node == 0 and args.tensorboard:  # a folder: a file in it
        outputs.append(("--tensorboard", os.path.join(args.tensorboard, "events")))
    if not args.evaluate and writes:
        outputs.append(("--checkpoint", args.checkpoint))
    for flag, path in [(f, p) for f, p in outputs if p]:  # created (and said) or refused now
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder)
            if place.local_rank == 0:
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
    if sharded and writes and args.checkpoint and not args.evaluate:
        checkpoint.check_links(args.checkpoint)
