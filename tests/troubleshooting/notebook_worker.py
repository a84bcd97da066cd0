"""The worker of a notebook cell, moved into a module so that mp.spawn's processes can import
it (docs/troubleshooting.md, Jupyter)."""
import os


def worker(rank):
    os.write(1, f"worker {rank} runs\n".encode())  # one write: the workers share the pipe
