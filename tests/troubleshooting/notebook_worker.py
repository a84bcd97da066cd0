"""The worker of a notebook cell, moved into a module so that mp.spawn's processes can import
it (docs/troubleshooting.md, Jupyter)."""


def worker(rank):
    print(f"worker {rank} runs", flush=True)
