"""One rank busy alone while the others wait, with a 3-second process-group timeout (two gloo
processes; docs/troubleshooting.md, "Long work on rank 0 only").

    python tests/troubleshooting/waiting_for_one_rank.py rank0
        1. rank 0 works 6 s alone, then both ranks meet at a barrier of a second group created
           with a 60-second timeout: they pass it, and the main group goes on with its 3 s;
        2. rank 0 works 6 s alone again, then both call dist.monitored_barrier(timeout=20 s):
           rank 1 still waits for rank 0 with the main group's 3 s, and fails.
    python tests/troubleshooting/waiting_for_one_rank.py rank1
        rank 1 works 6 s alone while both call dist.monitored_barrier(timeout=3 s): rank 0
        reports which rank did not arrive.
"""
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
# Before any process group exists, as in common.py: imported later (by DDP), this module pins
# the group and gloo's threads can abort the process at exit (tests/test_shutdown.py).
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp

TIMEOUT, WORK = 3, 6  # seconds


def worker(rank, port, late):
    def say(what):
        # one write() of the whole line: the two processes share the pipe, and print() may
        # write the text and its newline separately, which interleaves lines
        os.write(1, f"[{time.monotonic() - start:4.1f}s] rank {rank}: {what}\n".encode())

    def monitored_barrier(seconds):
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=seconds))
            say("passed monitored_barrier")
        except RuntimeError as e:
            say(f"monitored_barrier failed: {str(e).splitlines()[0]}")
            raise SystemExit(1)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=TIMEOUT))
    if late == "rank0":
        patient = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        start = time.monotonic()
        if rank == 0:
            time.sleep(WORK)  # a long save, an evaluation, a download, ... on rank 0 alone
        dist.barrier(group=patient)
        dist.all_reduce(torch.ones(1))
        say("passed the barrier of the group with the 60 s timeout")
        start = time.monotonic()
        if rank == 0:
            time.sleep(WORK)
        monitored_barrier(20)
    else:
        start = time.monotonic()
        if rank == 1:
            time.sleep(WORK)
        monitored_barrier(TIMEOUT)


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the group's store
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, sys.argv[1]), nprocs=2)
