"""Ranks out of step: rank 0 alone all-reduces a number for a log line, then both broadcast.
Two gloo processes on this machine; docs/troubleshooting.md runs it with and without
TORCH_DISTRIBUTED_DEBUG=DETAIL.

    python tests/troubleshooting/mismatch.py [TIMEOUT_SECONDS]
"""
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
# Before any process group exists, as in common.py: imported later (by DDP), this module pins
# the group and gloo's threads can abort the process at exit (tests/test_shutdown.py).
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp


def worker(rank, port, timeout):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout))
    dist.all_reduce(torch.ones(4))            # both ranks
    if rank == 0:
        dist.all_reduce(torch.ones(1))        # the bug: only rank 0 reduces its loss to log it
    dist.broadcast(torch.ones(4), src=0)      # both ranks
    os.write(1, f"rank {rank} finished\n".encode())  # one write: the ranks share the pipe
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, float(sys.argv[1]) if len(sys.argv) > 1 else 5),
             nprocs=2)
