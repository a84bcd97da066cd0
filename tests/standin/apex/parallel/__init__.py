"""STAND-IN for apex.parallel (tests only; see tests/standin/README.md). The signatures follow
apex/parallel/distributed.py and apex/parallel/__init__.py. The DDP stand-in is PyTorch's own
DistributedDataParallel underneath, so gradients really are averaged across processes."""
import torch

from apex import _log
from apex.amp import _state


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1,
                 allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False):
        _log("parallel.DistributedDataParallel", delay_allreduce=delay_allreduce,
             after_amp_initialize=_state["initialized"])
        super().__init__(module, device_ids=None)

    # apex's switch for skipping its all-reduce (gradient accumulation); here, DDP's own
    # (what no_sync() sets), read at the forward and in the backward.
    def disable_allreduce(self):
        self.require_backward_grad_sync = False

    def enable_allreduce(self):
        self.require_backward_grad_sync = True


SyncBatchNorm = torch.nn.SyncBatchNorm  # as apex with its syncbn extension (no import error)


def convert_syncbn_model(module, process_group=None, channel_last=False):
    _log("parallel.convert_syncbn_model",
         batchnorms=sum(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules()),
         after_amp_initialize=_state["initialized"])
    return module  # the stand-in keeps BatchNorm: SyncBatchNorm does not run on CPU
