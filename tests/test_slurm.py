"""The shipped SLURM batch files, submitted with `sbatch` to a real SLURM cluster of two nodes
(tests/slurm_cluster.py), 1 process per node on CPU.

What the tests set, through the environment sbatch passes to the job, exactly as a user may:
where the repository is (REPO), the Python, 1 process per node and 1 thread per process (each
test node has 2 cores), the checkpoint path; and training flags after the file name. The
#SBATCH lines (2 nodes, 4 GPUs, 16 cores per node) are submitted unchanged: the test cluster
declares that much, and the processes find no GPU and train on CPU with gloo.

A job's end state is read with `scontrol show job` (JobState and ExitCode; the cluster keeps
finished jobs for an hour, MinJobAge=3600): there is no slurmdbd, so no sacct.
"""
import shutil
import sys
import time

import pytest

from conftest import N_TEST, N_TRAIN, ROOT, assert_same_training_state, load, read_metrics, \
    read_records, script_env
from slurm_cluster import NODES, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slurm

BATCH = {"torchrun": ROOT / "slurm" / "torchrun_ddp.sbatch",
         "spawn": ROOT / "slurm" / "spawn_ddp.sbatch"}
# Two epochs in the schedule, this job stops after the first: the second submission of the
# same command must continue with epoch 2. Global batch 64 on 600 images: 10 steps an epoch.
TRAIN = ("--batch-size", 64, "--epochs", 2, "--stop-after", 1, "--log-interval", 5,
         "--timeout", 30)
JOB_TIMEOUT = 120


def submit_and_wait(cluster, launcher, jobdir, env, args):
    job = cluster.sbatch(BATCH[launcher], *map(str, args), env=env, cwd=jobdir)
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    out = (jobdir / f"mnist-{launcher}-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {job}: {info['JobState']} {info['ExitCode']}\n{out}{cluster.logs()}"
    return out


def node_records(cluster, name, kind):
    """What the process(es) on each node recorded, on that node's own disk."""
    return {n: read_records(cluster.disks[n] / name / "rec", kind) for n in NODES}


def check_job(cluster, name, ckpt_prefix):
    """Both nodes ran one process each in a world of 2; the save records, per node."""
    ranks = {}
    for n, samples in node_records(cluster, name, "sampler").items():
        [ranks[n]] = {s["rank"] for s in samples}  # one process on this node
        assert all(len(s["indices"]) == N_TRAIN // 2 for s in samples)  # half of each epoch
        assert (cluster.disks[n] / name / "rec" / f"final-rank{ranks[n]}.pt").exists()
    assert sorted(ranks.values()) == [0, 1], ranks
    return {n: {s["pid"] for s in saves if s["path"].startswith(str(ckpt_prefix))}
            for n, saves in node_records(cluster, name, "save").items()}


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_batch_file_on_two_nodes(slurm_cluster, tiny_mnist, tmp_path, launcher):
    """Three submissions of the same file: (1) a job that trains epoch 1 of 2 and writes its
    checkpoint on the shared disk, one writer in the job; (2) the same submission again,
    which continues from it with epoch 2; (3) with --save-on-each-node and the checkpoint on
    each node's local disk, holding a copy of (1)'s checkpoint: each node resumes from its
    own copy and writes its own, and the result equals (2)'s bit for bit."""
    cluster = slurm_cluster
    jobs = {}
    for job in ("first", "again", "each-node"):  # a folder of its own on every node's disk
        for n in NODES:
            (cluster.disks[n] / f"{tmp_path.name}-{job}" / "rec").mkdir(parents=True)

    def submit(job, ckpt, *extra):
        name = f"{tmp_path.name}-{job}"
        env = script_env(REPO=ROOT, PYTHON=sys.executable, NPROC_PER_NODE=1,
                         OMP_NUM_THREADS=1, CHECKPOINT=ckpt, SAVE_EVERY=4,
                         DDP_TEST_RECORD=cluster.local_disk / name / "rec")
        args = ["--data-dir", tiny_mnist, *TRAIN, "--metrics", "m.jsonl", *extra]
        start = time.monotonic()
        jobs[job] = submit_and_wait(cluster, launcher, tmp_path, env, args)
        print(f"{launcher} {job}: {time.monotonic() - start:.1f}s")
        return jobs[job], name

    # (1) one writer in the job, the checkpoint on the shared disk
    shared = tmp_path / "runs" / "c.pt"
    out, name = submit("first", shared)
    assert "2 node(s) x 1 process(es)" in out  # the batch file's own line
    assert "2 processes (2 node(s) x 1)" in out  # global rank 0's line
    rows = read_metrics(tmp_path / "m.jsonl")  # written by global rank 0, in the job's cwd
    assert [(r["epoch"], r["world_size"], r["total"]) for r in rows] == [(1, 2, N_TEST)]
    writers = check_job(cluster, name, shared)
    assert len(set().union(*writers.values())) == 1, writers  # one process wrote, every time
    assert sorted(p.name for p in shared.parent.iterdir()) == ["c.pt"]  # no temp file left
    assert load(shared)["epoch"] == 1
    for n in NODES:  # what (3) will start from: a copy on each node's own disk
        shutil.copy(shared, cluster.disks[n] / f"{tmp_path.name}-each-node" / "c.pt")

    # (2) the same submission again continues from the checkpoint with epoch 2
    out, name = submit("again", shared)
    assert f"loaded {shared}: 1 epoch(s) + 0 step(s) trained" in out, out
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(tmp_path / "m.jsonl")] == \
        [(1, 2), (2, 2)]
    writers = check_job(cluster, name, shared)
    assert len(set().union(*writers.values())) == 1, writers
    assert load(shared)["epoch"] == 2

    # (3) no shared disk for checkpoints: one writer per node, each into its own directory
    local = cluster.local_disk / f"{tmp_path.name}-each-node" / "c.pt"  # same path, each node
    out, name = submit("each-node", local, "--save-on-each-node")
    assert f"loaded {local}: 1 epoch(s) + 0 step(s) trained" in out, out
    writers = check_job(cluster, name, local)
    assert all(len(writers[n]) == 1 for n in NODES), writers  # one writer on each node
    copies = [load(cluster.disks[n] / name / "c.pt") for n in NODES]
    for copy in copies:
        assert_same_training_state(load(shared), copy)  # == (2): same training, either way
