"""DDP's constructor under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo: one process, a group of one in
memory. docs/troubleshooting.md runs it with TORCH_CPP_LOG_LEVEL=INFO, which makes DDP log the
gloo group's thread count (`gloo_num_threads`): 2 without DETAIL; with it, DDP reads the count
from DETAIL's wrapper as if it were the gloo group, and either crashes (SIGSEGV) or logs a number
from the wrong object.

    TORCH_CPP_LOG_LEVEL=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL python tests/troubleshooting/ddp_detail.py
"""
import os

import torch
import torch.distributed as dist
# Before any process group exists, as in common.py: imported later (by DDP), this module pins
# the group and gloo's threads can abort the process at exit (tests/test_shutdown.py).
import torch.distributed.nn  # noqa: F401

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
os.write(1, b"DDP constructed\n")
dist.destroy_process_group()
