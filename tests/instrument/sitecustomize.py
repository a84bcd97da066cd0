"""Test instrumentation, loaded into every Python process of a test run (the launcher and each
worker) when tests put this folder on PYTHONPATH. It observes what the real scripts do and
changes none of their results:

  DDP_TEST_RECORD=DIR   record each rank's training-sampler indices per epoch, every torch.save
                        call, each rank's final model state at destroy_process_group, and the
                        threads each rank still runs when its script has returned (at exit)
  DDP_TEST_BLOCK=NAME   make `import NAME` fail, to test the message for a missing package
  DDP_TEST_STEP_DELAY=S sleep S seconds before every optimizer step (slower, same results), so
                        that a test can kill a worker in the middle of an epoch
  DDP_TEST_SLOW_SAVE=S  torch.save (to a path or a file) writes half the bytes, sleeps S
                        seconds, then writes the rest (a slow disk), so that a kill can land
                        mid-write
  DDP_TEST_CPU_FEATURES=avx512_bf16=0,amx_bf16=1,...
                        torch.cpu.get_capabilities() reports these features as given (read at
                        each call), so a test decides what CPU the scripts believe they run on
  DDP_TEST_NOT_LINUX=1  a stand-in for macOS and Windows: os.sched_getaffinity and
                        os.sched_setaffinity are gone and /proc cannot be read
With DDP_TEST_RECORD, every optimizer step also records the learning rate it used.
"""
import atexit
import io
import json
import os
import sys
import time

if os.environ.get("DDP_TEST_BLOCK"):
    sys.modules[os.environ["DDP_TEST_BLOCK"]] = None  # import NAME now raises ImportError

if os.environ.get("DDP_TEST_STEP_DELAY"):
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _delay = float(os.environ["DDP_TEST_STEP_DELAY"])
    register_optimizer_step_pre_hook(lambda *_: time.sleep(_delay))

if os.environ.get("DDP_TEST_SLOW_SAVE"):
    import torch
    _slow, _fast_save = float(os.environ["DDP_TEST_SLOW_SAVE"]), torch.save

    def _slow_save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        _fast_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # a path or a file
        out.write(data[:len(data) // 2])
        out.flush()
        time.sleep(_slow)
        out.write(data[len(data) // 2:])
        if out is not f:
            out.close()
    torch.save = _slow_save

if "DDP_TEST_CPU_FEATURES" in os.environ:
    import torch
    _real_capabilities = torch.cpu.get_capabilities

    def _capabilities():
        caps = dict(_real_capabilities())
        for item in filter(None, os.environ.get("DDP_TEST_CPU_FEATURES", "").split(",")):
            name, value = item.split("=")
            caps[name.strip()] = bool(int(value))
        return caps
    torch.cpu.get_capabilities = _capabilities

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

RECORD = os.environ.get("DDP_TEST_RECORD")
if RECORD:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    def _append(name, obj):
        with open(os.path.join(RECORD, f"{name}-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(obj) + "\n")

    _sampler_iter = DistributedSampler.__iter__

    def _recording_iter(self):
        indices = list(_sampler_iter(self))
        if self.shuffle:  # the training sampler
            _append("sampler", {"rank": self.rank, "epoch": self.epoch, "indices": indices})
        return iter(indices)
    DistributedSampler.__iter__ = _recording_iter

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def _record_lr(optimizer, args, kwargs):
        _append("lr", {"rank": dist.get_rank() if dist.is_initialized() else 0,
                       "lr": optimizer.param_groups[0]["lr"]})
    register_optimizer_step_pre_hook(_record_lr)

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        _append("save", {"pid": os.getpid(), "path": str(getattr(f, "name", f))})
        return _save(obj, f, *args, **kwargs)
    torch.save = _recording_save

    _wrapped = []
    _ddp_init = DistributedDataParallel.__init__

    def _recording_init(self, module, *args, **kwargs):
        _wrapped.append(module)
        _ddp_init(self, module, *args, **kwargs)
    DistributedDataParallel.__init__ = _recording_init

    _destroy = dist.destroy_process_group

    def _recording_destroy(*args, **kwargs):
        if _wrapped and dist.is_initialized():
            _save(_wrapped[-1].state_dict(),
                  os.path.join(RECORD, f"final-rank{dist.get_rank()}.pt"))
        return _destroy(*args, **kwargs)
    dist.destroy_process_group = _recording_destroy

    _init_pg = dist.init_process_group
    _ranks = []

    def _recording_init_pg(*args, **kwargs):
        _init_pg(*args, **kwargs)
        _ranks.append(dist.get_rank())
    dist.init_process_group = _recording_init_pg

    def _record_threads_at_exit():
        # atexit runs after the script has returned and before the interpreter tears down.
        # gloo's threads (named gloo_* / pt_gloo_*) are C++ threads, invisible to `threading`.
        if _ranks:
            names = []
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        names.append(f.read().strip())
                except OSError:  # the thread ended meanwhile
                    pass
            _append("exit", {"rank": _ranks[-1], "threads": sorted(names)})
    atexit.register(_record_threads_at_exit)
