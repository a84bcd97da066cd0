"""Test instrumentation, loaded into every Python process of a test run (the launcher and each
worker) when tests put this folder on PYTHONPATH. It observes what the real scripts do and
changes none of their results:

  DDP_TEST_RECORD=DIR   record each rank's training-sampler indices per epoch, every torch.save
                        call, each rank's final model state at destroy_process_group, and the
                        threads each rank still runs when its script has returned (at exit)
  DDP_TEST_BLOCK=NAME   make `import NAME` fail, to test the message for a missing package
  DDP_TEST_STEP_DELAY=S sleep S seconds before every optimizer step (slower, same results), so
                        that a test can kill a worker in the middle of an epoch
  DDP_TEST_SLOW_SAVE=S  torch.save to a path writes half the bytes, sleeps S seconds, then
                        writes the rest (a slow disk), so that a kill can land mid-write
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
        if not isinstance(f, (str, os.PathLike)):
            return _fast_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        _fast_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        with open(f, "wb") as out:
            out.write(data[:len(data) // 2])
            out.flush()
            time.sleep(_slow)
            out.write(data[len(data) // 2:])
    torch.save = _slow_save

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

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        _append("save", {"pid": os.getpid(), "path": str(f)})
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
