"""A model with a parameter that gets no gradient, under DDP: two gloo processes, three steps
each, with DDP's defaults, with find_unused_parameters=True and with static_graph=True. Prints
how each ended (rank 0). docs/troubleshooting.md quotes it.

    python tests/troubleshooting/unused_parameters.py
"""
import os
import socket

import torch
import torch.distributed as dist
# Before any process group exists, as in common.py: imported later (by DDP), this module pins
# the group and gloo's threads can abort the process at exit (tests/test_shutdown.py).
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        return self.used(self.body(x))  # self.unused takes no part in the loss


def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    for options in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        model = DDP(TwoHeads(), **options)
        try:
            for step in range(3):
                model(torch.randn(4, 8)).sum().backward()
            outcome = "3 steps done"
        except RuntimeError as e:
            outcome = f"step {step} failed: {e}"
        if rank == 0:  # one write() of the whole text: rank 1's log lines share the pipe
            how = "".join(f", {k}={v}" for k, v in options.items())
            os.write(1, f"--- DDP(model{how}): {outcome}\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
