"""Resuming is decided by all processes together (common.agreed_checkpoint). Two "nodes" on
this machine, each in a folder of its own (a node-local disk), with --save-on-each-node: after
epoch 1 of 2, one node's checkpoint is deleted (a node that joins with an empty disk, a
requeue onto another node, a missing mount). The same command again: both nodes resume, the
one without a copy receives it from the other, and the run ends bit-identical to one that was
never interrupted, each node with its own copy. Before, each process decided alone and the two
ran different collectives, until --timeout. (The SLURM batch files are tested the same way in
test_slurm.py.)"""
import shutil
import subprocess
import sys
import uuid
from collections import Counter

import pytest

from conftest import ROOT, assert_same_training_state, free_port, load, read_metrics, \
    read_records, script_env

pytestmark = pytest.mark.slow

ARGS = ("--batch-size", 64, "--epochs", 2, "--log-interval", 5, "--timeout", 60,
        "--save-on-each-node", "--checkpoint", "ckpt/c.pt", "--metrics", "m.jsonl")
PIECE = 100_000  # bytes (resumable.PIECE, made small: the checkpoint is about 1 MB)
MESSAGE = "had no copy of ckpt/c.pt at 1 epoch(s) + 0 step(s): rank {} sends its copy"


@pytest.fixture
def never_interrupted(straight):
    """2 processes on one node, 2 epochs (conftest): two nodes of one process each train the
    same (one thread per process everywhere, so that the arithmetic is the same too)."""
    return load(straight(2, 64, 2) / "c.pt")


def launch(cmds, folders, **env):
    procs = [subprocess.Popen(cmd, cwd=f, env=script_env(OMP_NUM_THREADS=1, **env), text=True,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
             for cmd, f in zip(cmds, folders)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    return outs


def torchrun_nodes(tiny_mnist, folders, *extra, **env):
    port, job = free_port(), uuid.uuid4().hex[:8]
    return launch([[sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
                    str(ROOT / "torchrun_ddp.py"), "--data-dir", str(tiny_mnist),
                    *map(str, ARGS), *map(str, extra)] for _ in folders], folders, **env)


def spawn_nodes(tiny_mnist, folders, *extra, resume_on=(), nproc=1, **env):
    port = free_port()
    return launch([[sys.executable, str(ROOT / "spawn_ddp.py"), "--data-dir", str(tiny_mnist),
                    "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", str(nproc),
                    "--master-addr", "127.0.0.1", "--master-port", str(port), *map(str, ARGS),
                    *map(str, extra), *(["--resume"] if n in resume_on else [])]
                   for n in range(len(folders))], folders, **env)


def check_resumed(folders, outs, never_interrupted):
    text = "\n".join(outs)
    assert sum("loaded ckpt/c.pt: 1 epoch(s) + 0 step(s) trained" in o for o in outs) == 1, text
    assert "had no copy of ckpt/c.pt at 1 epoch(s) + 0 step(s): rank " in text, text
    for f in folders:  # each node wrote its own copy again, the same model on both
        assert_same_training_state(never_interrupted, load(f / "ckpt" / "c.pt"))
    [reporter] = [f for f in folders if (f / "m.jsonl").exists()]
    assert [r["epoch"] for r in read_metrics(reporter / "m.jsonl")] == [1, 2]


def test_torchrun_node_without_the_checkpoint_receives_it(tiny_mnist, tmp_path,
                                                          never_interrupted):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        f.mkdir()
    torchrun_nodes(tiny_mnist, folders, "--stop-after", 1)
    assert all(load(f / "ckpt" / "c.pt")["epoch"] == 1 for f in folders)
    size = (folders[1] / "ckpt" / "c.pt").stat().st_size
    (folders[1] / "ckpt" / "c.pt").unlink()  # node 1's disk lost it
    rec = tmp_path / "rec"
    rec.mkdir()
    check_resumed(folders, torchrun_nodes(tiny_mnist, folders, DDP_TEST_RECORD=rec,
                                          DDP_TEST_PIECE=PIECE), never_interrupted)
    # Node 1 received the file in pieces of at most PIECE bytes, the whole file in all ...
    pieces = [r["bytes"] for r in read_records(rec, "broadcast") if r["rank"] == 1]
    assert max(pieces) <= PIECE and sum(p for p in pieces if p > 8) >= size, pieces
    # ... and each process read a checkpoint once, mapped onto the CPU: node 0 its own, node 1
    # the copy it received (check_args of a torchrun worker reads none).
    loads = read_records(rec, "load")
    assert sorted(Counter(r["pid"] for r in loads).values()) == [1, 1], loads
    assert all(r["map_location"] == "cpu" and r["mmap"] for r in loads), loads


def test_spawn_node_without_the_checkpoint_receives_it(tiny_mnist, tmp_path, never_interrupted):
    """As slurm/spawn_ddp.sbatch runs it: --resume on the node that finds the file only."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        f.mkdir()
    spawn_nodes(tiny_mnist, folders, "--stop-after", 1)
    (folders[0] / "ckpt" / "c.pt").unlink()  # node 0, rank 0's, this time
    outs = spawn_nodes(tiny_mnist, folders, resume_on=[1])
    assert MESSAGE.format(1) in "\n".join(outs)
    check_resumed(folders, outs, never_interrupted)


def test_one_copy_per_node(tiny_mnist, tmp_path):
    """Two nodes of 2 processes; node 1 lost its copy. Its two processes receive the file as
    one copy, written by the first of them beside the checkpoint, read by both (node 1's two
    processes load the same file) and removed once both have mapped it; the run ends as the
    same resume with every copy in place does. (Before: one temporary copy per process, eight
    on an 8-GPU node. At 4 processes a resume ends as a resume does, not as a run never
    interrupted: docs/preemption.md, "Resume decisions".)"""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        f.mkdir()
    spawn_nodes(tiny_mnist, folders, "--stop-after", 1, nproc=2)
    reference = [tmp_path / "ref0", tmp_path / "ref1"]
    for f, ref in zip(folders, reference):
        shutil.copytree(f, ref)
    spawn_nodes(tiny_mnist, reference, resume_on=[0, 1], nproc=2)
    (folders[1] / "ckpt" / "c.pt").unlink()
    rec = tmp_path / "rec"
    rec.mkdir()
    outs = spawn_nodes(tiny_mnist, folders, resume_on=[0], nproc=2, DDP_TEST_RECORD=rec)
    assert MESSAGE.format(0).replace("rank(s) ", "rank(s) 2, 3 ") in "\n".join(outs), outs
    loads = read_records(rec, "load")
    received = [r for r in loads if not r["path"].endswith("c.pt")]  # (node 0's launcher checks
    assert len({r["pid"] for r in received}) == 2, loads               # its file first)
    assert len({r["path"] for r in received}) == 1, loads
    assert received[0]["path"].startswith(str(folders[1] / "ckpt")), loads
    resumed = load(reference[0] / "ckpt" / "c.pt")
    for f in folders:
        assert sorted(p.name for p in (f / "ckpt").iterdir()) == ["c.pt"]  # the copy is gone
        assert_same_training_state(resumed, load(f / "ckpt" / "c.pt"))
