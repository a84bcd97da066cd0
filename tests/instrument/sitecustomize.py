"""Test instrumentation, loaded into every Python process of a test run (the launcher and each
worker) when tests put this folder on PYTHONPATH. It observes what the real scripts do and
changes none of their results:

  DDP_TEST_RECORD=DIR   record each rank's training-sampler indices per epoch, every torch.save
                        call, and each rank's final model state at destroy_process_group
  DDP_TEST_BLOCK=NAME   make `import NAME` fail, to test the message for a missing package
"""
import json
import os
import sys

if os.environ.get("DDP_TEST_BLOCK"):
    sys.modules[os.environ["DDP_TEST_BLOCK"]] = None  # import NAME now raises ImportError

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
