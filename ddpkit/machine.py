"""The machine each process trains on: its device (its own GPU, or its share of the CPU's
cores) and the precision it computes in, decided here alone (--amp auto asks torch whether the
device computes bfloat16, and the job takes one answer). Portable: Linux, macOS, Windows."""
import os

import torch

import common
from common import Fatal


def process_device(local_rank, local_world_size):
    """This process's device: its own GPU, made current (so that NCCL and every .cuda() use it),
    or the CPU. Either way it computes on its share of the cores, which processes on one machine
    otherwise fight over (pytorch/pytorch#22260); OMP_NUM_THREADS, if set, wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cpu_count() // local_world_size))
    elif not os.environ["OMP_NUM_THREADS"].isdigit() or int(os.environ["OMP_NUM_THREADS"]) < 1:
        raise Fatal(f"OMP_NUM_THREADS: expected an integer > 0, got "
                    f"{os.environ['OMP_NUM_THREADS']!r}")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
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


def settle_precision(args, place, device, lacking, resumed=None, log=print):
    """--amp auto, decided once for the whole job when its processes agree (checkpoint.agreed,
    whose one gather carries every process's `computes_bf16`), and said once. A resumed run
    keeps the precision it was trained in (`resumed`); a new one trains in bf16 only if no
    rank's device lacks bfloat16 (`lacking`: their ranks), else in fp32. (Each deciding alone,
    the ranks of one job on GPUs of two generations would train in two precisions.)"""
    if args.amp != "auto" or args.evaluate:
        return
    gpu = device.index if device.type == "cuda" else None
    if resumed:
        args.amp = resumed
        log(f"precision: {PRECISION[args.amp]}, the precision the checkpoint was trained in "
            "(--amp auto)")
        if place.local_rank == 0:
            warn_if_slower(args.amp, gpu)
        return
    fast, why = computes_bf16(gpu)
    args.amp = "bf16" if fast and not lacking else "none"
    if fast and lacking:
        why = f"the device of rank(s) {', '.join(map(str, lacking))} has no bfloat16 " \
              "arithmetic and all train in one precision"
    log(f"precision: {PRECISION[args.amp]}, as {why} (--amp auto; --amp none: fp32)")


def warn_if_slower(amp, gpu):
    """A warning line where --amp `amp` runs slower than fp32 on GPU number `gpu` (None: CPU)."""
    fast, why = computes_bf16(gpu) if amp == "bf16" else (None, "")
    if amp == "fp16" and gpu is None:
        fast, why = False, "float16 autocast on a CPU ran many times slower (docs/training.md)"
    if fast is False:
        common.say(f"warning: --amp {amp} on this {'CPU' if gpu is None else 'GPU'} is slower "
                   f"than fp32: {why}{', so bf16 is emulated' * (amp == 'bf16')}"
                   f"{'; use fp16' * (gpu is not None)}")


def deterministic(on):
    """--deterministic, in each process before any CUDA work: only algorithms that give the same
    result every run (torch raises for an op that has none), cuDNN's deterministic kernels and no
    autotuning (cudnn.benchmark times kernels at each new shape and may pick others run to run;
    torch leaves it off too), and the workspace deterministic cuBLAS needs (docs/training.md)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def check_host_memory(model, nproc):
    """FSDP: every process builds the whole model in host memory before it shards it, `nproc`
    copies at once on this machine. Where they cannot fit what Linux says is available, a line
    now (`model` is on the meta device: its sizes without memory), not the OOM killer later."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # not Linux
        return
    need = sum(t.nbytes for t in model.state_dict().values())
    if need * nproc > free:
        raise Fatal(f"each of the {nproc} processes on this machine builds the whole model "
                    f"({need / 2**30:.1f} GiB) in host memory before sharding it: "
                    f"{need * nproc / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is available; "
                    "start fewer per machine (--nproc-per-node), or see docs/fsdp.md")
