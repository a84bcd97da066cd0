"""Test instrumentation, loaded into every Python process of a test run (the launcher and each
worker) when tests put this folder on PYTHONPATH. It observes what the real scripts do and
changes none of their results:

  DDP_TEST_RECORD=DIR   record each rank's training-sampler indices per epoch, every torch.save
                        and torch.load call, each rank's final model state and the files it
                        maps at destroy_process_group, the threads each rank still runs when
                        its script has returned (at exit, and at os._exit: then no
                        finalization follows, and the exit code is known), the optimizer
                        steps each rank had begun when a SIGTERM reached it, every fork (whether a process group existed, and
                        the threads then running), every process group made after the first,
                        the size of every tensor broadcast and the shape and dtype of every one all-reduced,
                        and how long the store given to init_process_group waits
  DDP_TEST_BLOCK=NAME   make `import NAME` fail, to test the message for a missing package
  DDP_TEST_STEP_DELAY=S sleep S seconds before every optimizer step (slower, same results), so
                        that a test can kill a worker in the middle of an epoch
  DDP_TEST_THREAD_POOL=1
                        every process that imports torch keeps a ThreadPoolExecutor with one idle
                        worker thread, as a task that reads its data through one does (fsspec,
                        s3fs): a thread that ends only when Python's exit asks it to
  DDP_TEST_FAIL_SAVE=N  the N-th torch.save of a process fails as on a full disk (ENOSPC)
  DDP_TEST_SLOW_SAVE=S  torch.save (to a path or a file) writes half the bytes, sleeps S
                        seconds, then writes the rest (a slow disk), so that a kill can land
                        mid-write
  DDP_TEST_CPU_FEATURES=avx512_bf16=0,amx_bf16=1,...
                        torch.cpu.get_capabilities() reports these features as given (read at
                        each call), so a test decides what CPU the scripts believe they run on
                        ("unknown": it reports nothing, as where torch cannot tell)
  DDP_TEST_NOT_LINUX=1  a stand-in for macOS and Windows: os.sched_getaffinity and
                        os.sched_setaffinity are gone and /proc cannot be read
  DDP_TEST_MEM_AVAILABLE=BYTES
                        /proc/meminfo says that BYTES of memory are available (a machine with
                        less memory), and nothing else
  DDP_TEST_NO_SYMLINKS=1
                        os.symlink fails with EPERM, as on a filesystem without links (FAT, some
                        SMB and FUSE mounts)
  DDP_TEST_NO_CHECK=1   common.evaluate(..., batches=1) does nothing: the scripts without the
                        test batch they evaluate before training, to show that it leaves no trace
  DDP_TEST_NO_STOP=1    sigterm.StopSignal never stops the run and runs no all-reduce: the
                        scripts without their per-step SIGTERM check, so that bench.py can
                        measure what the check costs (--with-env, see docs/speed.md)
  DDP_TEST_ALLREDUCE_LOG=DIR
                        each process appends to DIR/allreduce-PID.jsonl one line for every
                        gradient all-reduce DDP runs (one per bucket, through a communication
                        hook that does what DDP's default does), one for every reduce-scatter
                        (FSDP's gradient reduction), one for every training loss that
                        F.cross_entropy computes (a micro-batch's forward) and one for every
                        optimizer step, in the order they happen
  DDP_TEST_STALL=RANK:STEP:S
                        the process of global rank RANK sleeps S seconds before its STEP-th
                        optimizer step (counted from 1 in that process), after that step's
                        gradient all-reduce: a rank stuck in slow work of its own while the
                        others wait for it in their next collective (docs/troubleshooting.md)
  DDP_TEST_SKIP_REDUCE=RANK:N
                        in the process of global rank RANK, the N-th call of
                        common.reduce_tensor returns its input without the all-reduce: one rank
                        skips a collective that the others run, as `if rank == 0:` around a
                        logging reduction would (docs/troubleshooting.md)
  DDP_TEST_LATE=RANK:S  the process of global rank RANK sleeps S seconds before it calls
                        init_process_group (after the processes met): a node still preparing
                        its data when the others already wait in init_process_group
  DDP_TEST_LATE_START=S  a process that its launcher started as local rank 0 (LOCAL_RANK, as
                        torchrun sets it) sleeps S seconds before anything else: its node's
                        first process, slow to import, while the others already run
  DDP_TEST_CPU_FEATURES_OF=RANK:FEATURES
                        in the process of global rank RANK, DDP_TEST_CPU_FEATURES is FEATURES
                        (asked once the process group exists): one machine of the job with
                        another CPU
  DDP_TEST_BACKEND_OF=RANK:KIND
                        the process of global rank RANK says at the meeting (launch.meet) that it
                        would train with KIND ("nccl on cuda"): one node of the job with GPUs
  DDP_TEST_STALL, DDP_TEST_SKIP_REDUCE and DDP_TEST_LATE print one line on stderr when they
  act ("test instrumentation: ...").
  DDP_SUITE_LAUNCH_LOG=FILE (set for the whole suite: the tests pass it on, unlike DDP_TEST_*)
                        every Python process appends "PID PPID TEST<tab>COMMAND LINE" to FILE,
                        TEST being pytest's current test: what each test starts
                        (docs/maintainers.md's table)
With DDP_TEST_RECORD, every optimizer step also records the learning rate it used, every
training loss that F.cross_entropy returns is recorded with its rank and its batch's size, and
every BatchNorm that runs in eval mode in a process group, its statistics' sums ("bn").
"""
import os
import sys

if os.environ.get("DDP_SUITE_LAUNCH_LOG"):  # which test started which Python process (Linux)
    try:
        with open("/proc/self/cmdline") as _f:
            _cmd = _f.read().split("\0")[:-1]
        with open(os.environ["DDP_SUITE_LAUNCH_LOG"], "a") as _f:
            _f.write(f"{os.getpid()} {os.getppid()} {os.environ.get('PYTEST_CURRENT_TEST')}\t"
                     f"{' '.join(_cmd)!r}\n")  # (repr: one line)
    except OSError:
        pass

if os.environ.get("DDP_TEST_LATE_START") and os.environ.get("LOCAL_RANK") == "0":
    import time
    time.sleep(float(os.environ["DDP_TEST_LATE_START"]))

if os.environ.get("DDP_TEST_BLOCK"):
    sys.modules[os.environ["DDP_TEST_BLOCK"]] = None  # import NAME now raises ImportError

if os.environ.get("DDP_TEST_NOT_LINUX"):
    import builtins
    for _name in ("sched_getaffinity", "sched_setaffinity"):  # Linux only (Python docs)
        if hasattr(os, _name):
            delattr(os, _name)
    _open = builtins.open

    def _open_without_proc(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and os.fsdecode(file).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory (no /proc here)", file)
        return _open(file, *args, **kwargs)
    builtins.open = _open_without_proc

if os.environ.get("DDP_TEST_MEM_AVAILABLE"):
    import builtins
    import io
    _real_open = builtins.open

    def _open_meminfo(file, *args, **kwargs):
        if isinstance(file, str) and file == "/proc/meminfo":
            return io.StringIO(f"MemAvailable: {int(os.environ['DDP_TEST_MEM_AVAILABLE']) // 1024}"
                               " kB\n")
        return _real_open(file, *args, **kwargs)
    builtins.open = _open_meminfo

if os.environ.get("DDP_TEST_NO_SYMLINKS"):
    def _no_symlink(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    os.symlink = _no_symlink


def _patch_module(name, patch):
    """Calls patch(module) once the script has imported the module `name` of the repository
    (not on the path yet, so a meta path finder waits for the import)."""
    import importlib.abc
    import importlib.util

    class _Patcher(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Patcher())


if os.environ.get("DDP_TEST_NO_CHECK"):
    def _no_first_test_batch(common):
        evaluate = common.evaluate
        common.evaluate = lambda *a, batches=None, **k: {} if batches else evaluate(*a, **k)
    _patch_module("common", _no_first_test_batch)

if os.environ.get("DDP_TEST_NO_STOP"):
    def _no_stop_check(sigterm):
        sigterm.StopSignal.__call__ = lambda self, step: False
    _patch_module("ddpkit.sigterm", _no_stop_check)

def _global_rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


if os.environ.get("DDP_TEST_SKIP_REDUCE"):
    _skip_rank, _skip_call = map(int, os.environ["DDP_TEST_SKIP_REDUCE"].split(":"))

    def _skip_one_reduce(common):
        reduce, calls = common.reduce_tensor, [0]

        def reduce_tensor(t):
            calls[0] += 1
            if calls[0] == _skip_call and _global_rank() == _skip_rank:
                print(f"test instrumentation: rank {_skip_rank} skips reduce_tensor "
                      f"call {_skip_call} (pid {os.getpid()})", file=sys.stderr, flush=True)
                return t.clone()
            return reduce(t)
        common.reduce_tensor = reduce_tensor
    _patch_module("common", _skip_one_reduce)

if os.environ.get("DDP_TEST_BACKEND_OF"):
    def _other_backend(launch):
        rank, kind = os.environ["DDP_TEST_BACKEND_OF"].split(":", 1)
        meet = launch.meet

        def meet_as_other(store, place, args, own):
            return meet(store, place, args, kind if place.rank == int(rank) else own)
        launch.meet = meet_as_other
    _patch_module("ddpkit.launch", _other_backend)

# The rest needs torch, and is loaded with it, not before: a process that never imports torch
# (multiprocessing's resource tracker, which mp.spawn starts) does not pay for its import.
if any(k.startswith("DDP_TEST_") for k in os.environ):
    _patch_module("torch", lambda torch: __import__("instrument_torch"))
