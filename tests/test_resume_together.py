"""Resuming is decided by all processes together (checkpoint.agreed). Two "nodes" on this
machine, each in a folder of its own (a node-local disk), with --save-on-each-node: after epoch
1 of 2, one node's checkpoint is deleted (a node that joins with an empty disk, a requeue onto
another node, a missing mount). The same command again is refused in one line per node, before
anything trains, and every copy that is left stays as it was; once the file is copied to that
node, the run resumes and ends bit-identical to one that was never interrupted. Before the
agreement, each process decided alone and the two ran different collectives, until --timeout.
(The SLURM batch files resume with a copy on each node: test_slurm.py.)"""
import shutil
import sys
import uuid

import pytest

from conftest import ROOT, TRAIN, assert_same_training_state, free_port, load, read_metrics, \
    spawn_nodes, together

pytestmark = pytest.mark.slow

ARGS = (*TRAIN, "--log-interval", 5, "--timeout", 60, "--save-on-each-node", "--checkpoint",
        "ckpt/c.pt", "--metrics", "m.jsonl")
REFUSED = "error: rank(s) {} (node(s) {}) lack the copy of ckpt/c.pt that rank {} resumes from " \
          "(1 epoch(s) + 0 step(s)): copy it to that node, or use a shared filesystem"


@pytest.fixture
def never_interrupted(straight):
    """2 processes on one node, 2 epochs (conftest): two nodes of one process each train the
    same (one thread per process everywhere, so that the arithmetic is the same too)."""
    return load(straight(2) / "c.pt")


def run_nodes(cmds, folders, codes):
    """Each node's command in its folder (conftest.together): their outputs, once each ended
    with `codes`."""
    rs = together(cmds, cwd=lambda n: folders[n], OMP_NUM_THREADS=1)
    assert tuple(r.returncode for r in rs) == codes, rs
    return [r.stdout + r.stderr for r in rs]


def torchrun_nodes(tiny_mnist, folders, codes=(0, 0)):
    port, job = free_port(), uuid.uuid4().hex[:8]
    return run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                       "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
                       ROOT / "torchrun_ddp.py", "--data-dir", tiny_mnist, *ARGS]
                      for _ in folders], folders, codes)


def spawned(tiny_mnist, folders, resume_on=(), nproc=1, codes=(0, 0)):
    """spawn_ddp.py's nodes (conftest.spawn_nodes), each in its folder: their outputs, once each
    ended with `codes`."""
    rs = spawn_nodes(lambda n: ["--data-dir", tiny_mnist, "--nproc-per-node", nproc, *ARGS,
                                *(["--resume"] if n in resume_on else [])],
                     cwd=lambda n: folders[n], OMP_NUM_THREADS=1)
    assert tuple(r.returncode for r in rs) == codes, rs
    return [r.stdout + r.stderr for r in rs]


def refused(outs, line, kept, alone=False):
    """Each node's output holds `line` once (`alone`: and no other error line, nor torch's
    "Terminating process") and no training; `kept` ({path: bytes}) is intact."""
    for out in outs:
        assert sum(line in ln for ln in out.splitlines()) == 1, out
        assert not alone or ("Terminating" not in out and out.count("error:") == 1), out
        assert "loaded" not in out and " step " not in out, out
    assert all(path.read_bytes() == before for path, before in kept.items())


@pytest.fixture
def nodes(first_epoch, tmp_path):
    """Two nodes' folders, each with its copy of the checkpoint of epoch 1 of 2 at 2 processes
    (conftest.first_epoch), as --save-on-each-node leaves them (ckpt/c.pt)."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        (f / "ckpt").mkdir(parents=True)
        shutil.copy(first_epoch, f / "ckpt" / "c.pt")
    return folders


def test_torchrun_node_without_the_checkpoint_is_refused_until_it_has_a_copy(
        tiny_mnist, nodes, never_interrupted):
    folders = nodes
    copy = folders[0] / "ckpt" / "c.pt"
    (folders[1] / "ckpt" / "c.pt").unlink()  # node 1's disk lost it
    outs = torchrun_nodes(tiny_mnist, folders, codes=(1, 1))  # torchrun's, after its summary
    refused(outs, REFUSED.format(1, 1, 0), {copy: copy.read_bytes()})
    shutil.copy(copy, folders[1] / "ckpt" / "c.pt")  # what the line asks for
    outs = torchrun_nodes(tiny_mnist, folders)
    assert sum("loaded ckpt/c.pt: 1 epoch(s) + 0 step(s) trained" in o for o in outs) == 1, outs
    for f in folders:  # each node wrote its own copy again, the same model on both
        assert_same_training_state(never_interrupted, load(f / "ckpt" / "c.pt"))
    [reporter] = [f for f in folders if (f / "m.jsonl").exists()]
    assert [r["epoch"] for r in read_metrics(reporter / "m.jsonl")] == [2]  # epoch 2 here


def test_spawn_node_without_the_checkpoint_is_refused_in_one_line_per_node(tiny_mnist, nodes):
    """As slurm/spawn_ddp.sbatch runs it: --resume on the node that finds the file only, now
    with 2 processes a node. Node 0 (rank 0's) lost its copy; each node says so once, from its
    first process, and its launcher exits 2 (bad input), adding nothing."""
    folders = nodes
    (folders[0] / "ckpt" / "c.pt").unlink()
    copy = folders[1] / "ckpt" / "c.pt"
    outs = spawned(tiny_mnist, folders, resume_on=[1], nproc=2, codes=(2, 2))
    refused(outs, REFUSED.format("0, 1", 0, 2), {copy: copy.read_bytes()}, alone=True)
    assert not (folders[0] / "ckpt" / "c.pt").exists()


def test_a_resume_with_no_checkpoint_on_any_node_is_one_line_per_node(tiny_mnist, tmp_path):
    """Two spawn_ddp.py nodes of 2 processes each, --resume, and no checkpoint anywhere: one
    line per node, exit code 2 from each launcher (it was one line per process, torch's
    "Terminating process" notice and a launcher line of its own, exit code 1)."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    [f.mkdir() for f in folders]
    outs = spawned(tiny_mnist, folders, resume_on=[0, 1], nproc=2, codes=(2, 2))
    refused(outs, "error: no checkpoint at ckpt/c.pt on any node", {}, alone=True)
