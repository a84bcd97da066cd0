"""What an 8-GPU node would suffer from, seen where a CPU can show it (the rest: test_cuda.py).

- The SIGTERM stop agreement rides on the training backend: no second process group (a gloo
  group beside NCCL opens gloo connections between all ranks, on whatever interface the host
  name resolves to), and one all-reduce of one number every resumable.CHECK_EVERY steps.
- Data workers are forked before the process group starts its threads (a fork while they run
  can hang the child: python/cpython#112275), and share the training process's memory: the
  dataset is neither copied into /dev/shm (a container's default is 64 MB) nor sent over one
  descriptor per tensor ("too many fds" past 256).
- Two writers of one checkpoint path (a shared disk with --save-on-each-node) never share a
  temporary file. (A checkpoint read once per process onto the CPU, and sent in bounded pieces
  to a process without a copy: test_resume_together.py.)"""
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import common
import resumable
from conftest import ROOT, family, read_records, run_script, script_env

ARGS = ("--batch-size", 32, "--log-interval", 1000)  # 19 steps an epoch on the tiny MNIST


@pytest.mark.slow
def test_the_stop_agreement_is_one_number_every_k_steps_on_the_training_group(tiny_mnist,
                                                                               tmp_path):
    """2 epochs of 19 steps at 2 processes: with --checkpoint, each process all-reduces a tensor
    of one element (the stop flag; the loss is a 0-d tensor) once every CHECK_EVERY steps and
    before an epoch's last, and makes no process group; without --checkpoint a SIGTERM stops
    at once: no agreement."""
    runs = {"with": ["--checkpoint", tmp_path / "c.pt"], "without": []}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        run_script("spawn_ddp.py", "--data-dir", tiny_mnist, *ARGS, "--epochs", 2, *extra,
                   record=tmp_path / name)
    assert not read_records(tmp_path / "with", "group")  # no process group but training's
    checks = [r["rank"] for r in read_records(tmp_path / "with", "all_reduce") if r["shape"] == [1]]
    per_epoch = len([s for s in range(1, 20) if s % resumable.CHECK_EVERY == 0 or s == 19])
    assert sorted(checks) == sorted([0, 1] * 2 * per_epoch)
    assert not [r for r in read_records(tmp_path / "without", "all_reduce") if r["shape"] == [1]]


def shm_mapped(pid):
    """Bytes of /dev/shm files mapped into process `pid`."""
    total = 0
    try:
        for line in open(f"/proc/{pid}/maps"):
            if "/dev/shm/" in line:
                start, end = (int(a, 16) for a in line.split()[0].split("-"))
                total += end - start
    except OSError:
        pass
    return total


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_data_workers_are_forked_before_the_group_and_share_the_dataset(tmp_path):
    """spawn_ddp.py with MNIST's synthetic data (190 MB of float32 per process) and 2 workers
    per process: every fork happens while no process group exists (no gloo thread runs), and
    no process maps more than a few batches from /dev/shm (a fork server or spawn would map the
    whole dataset into each worker)."""
    cmd = [sys.executable, str(ROOT / "spawn_ddp.py"), "--dummy", "--workers", "2",
           "--epochs", "1", "--batch-size", "256", "--log-interval", "10"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=script_env(record=tmp_path))
    most = 0
    try:
        for line in proc.stdout:
            if line.startswith("epoch 1/1 step"):
                most = max([most] + [shm_mapped(p) for p in family(proc.pid)])
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()
    assert most and most < 32 << 20, most  # bytes
    forks = read_records(tmp_path, "fork")
    assert len(forks) >= 2 * (2 + 2)  # 2 processes, each 2 training and 2 test workers
    assert not [f for f in forks if f["group"] or any("gloo" in t for t in f["threads"])], forks


def write_many(path, n):
    for i in range(n):
        common.save_checkpoint({"model": {"w": torch.full((1000,), float(i))}, "epoch": i}, path)


def test_two_writers_of_one_path_never_share_a_temporary_file(tmp_path):
    """Two processes writing one checkpoint path, as two nodes with --save-on-each-node on a
    shared disk would: with one fixed temporary name, one renamed the other's file away ("could
    not write the checkpoint (No such file or directory)"); now each has its own."""
    path = str(tmp_path / "c.pt")
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=write_many, args=(path, 40)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]
    assert torch.load(path, weights_only=True)["epoch"] == 39
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_dataset_of_2000_small_tensors_loads_with_workers():
    """The scripts' workers (forked, started before any process group) load a dataset of 2,000
    small tensors; a fork server, which sends the dataset to each worker one descriptor per
    tensor, fails on it at once (Python's fork server passes at most 256)."""
    data = [torch.full((3,), float(i)) for i in range(2000)]
    loader = DataLoader(data, batch_size=100, num_workers=2, **resumable.worker_options(2))
    resumable.start_workers(loader)
    assert sorted(int(x[0]) for batch in loader for x in batch) == list(range(2000))
    control = DataLoader(data, batch_size=100, num_workers=2, multiprocessing_context="forkserver")
    with pytest.raises(Exception, match="too many fds"):
        list(control)
