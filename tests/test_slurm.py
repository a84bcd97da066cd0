"""The shipped SLURM batch files, submitted with `sbatch` to a real SLURM cluster of two nodes
(tests/slurm_cluster.py), 1 process per node on CPU.

What the tests set, through the environment sbatch passes to the job, exactly as a user may:
where the repository is (REPO), the Python, 1 process per node and 1 thread per process (each
test node has 2 cores), the checkpoint path; and training flags after the file name. The
#SBATCH lines (2 nodes, 4 GPUs, 16 cores per node) are submitted unchanged: the test cluster
declares that much, and the processes find no GPU and train on CPU with gloo.

A job's end state is read with `scontrol show job` (JobState, ExitCode and Restarts; the
cluster keeps finished jobs for an hour, MinJobAge=3600): there is no slurmdbd, so no sacct.

Time limit and preemption: the tests deliver SLURM's warning the way SLURM does for
`#SBATCH --signal=B:USR1@120` (to the batch shell only: `scancel --signal=USR1 --batch`), and
preempt a job with a job of a higher partition, and check that the job stops with a
snapshot, requeues itself and ends exactly where a job never interrupted ends.
"""
import re
import shutil
import sys
import time

import pytest

from conftest import N_TEST, N_TRAIN, ROOT, assert_same_training_state, load, read_metrics, \
    read_records, script_env
from slurm_cluster import NODES, TERMINAL, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slurm

BATCH = {"torchrun": ROOT / "slurm" / "torchrun_ddp.sbatch",
         "spawn": ROOT / "slurm" / "spawn_ddp.sbatch"}
JOB_TIMEOUT = 120


def submit_and_wait(cluster, launcher, jobdir, env, args):
    job = cluster.sbatch(BATCH[launcher], *map(str, args), env=env, cwd=jobdir)
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    out = (jobdir / f"mnist-{launcher}-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {job}: {info['JobState']} {info['ExitCode']}\n{out}{cluster.logs()}"
    assert info["Restarts"] == "0", out  # a job that ends normally does not requeue itself
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


# ---- Time limit and preemption ----------------------------------------------------------------
# Two epochs of 19 steps, each step slowed down so that the signal lands in the middle of epoch 1
# (the flags do not change what is trained: the reference below runs without the delay).
STOP_TRAIN = ("--batch-size", 32, "--epochs", 2, "--log-interval", 1, "--timeout", 30)
STEP_DELAY = 0.1
PREEMPTED = re.compile(r"preempted: stopped on SIGTERM after step (\d+) of epoch (\d+); "
                       r"snapshot in (\S+): ")


def stop_env(ckpt, **extra):
    return script_env(REPO=ROOT, PYTHON=sys.executable, NPROC_PER_NODE=1, OMP_NUM_THREADS=1,
                      CHECKPOINT=ckpt, SAVE_EVERY=4, **extra)


@pytest.fixture
def never_interrupted(straight):
    """The final checkpoint of the same training never interrupted: 2 processes of one thread,
    2 epochs at batch 32 (conftest). Every stopped and requeued job must end with it, bit for
    bit."""
    return load(straight(2) / "c.pt")


def submit_until_step(cluster, launcher, jobdir, env, args, step=3):
    """Submit; return the job id and its output file once global rank 0 has logged `step`
    steps of epoch 1."""
    job = cluster.sbatch(BATCH[launcher], *map(str, args), env=env, cwd=jobdir)
    out = jobdir / f"mnist-{launcher}-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out.exists() and f"epoch 1/2 step {step}/" in out.read_text()):
        info = cluster.job(job)
        if info["JobState"] in TERMINAL or time.monotonic() > deadline:
            cluster.client("scancel", job)
            pytest.fail(f"job {job}: {info['JobState']} before step {step}\n"
                        f"{out.read_text() if out.exists() else ''}{cluster.logs()}")
        time.sleep(0.1)
    return job, out


def check_stopped_and_requeued(cluster, job, out, ckpt, jobdir, reference):
    """One job id, two runs: the first stopped mid-epoch with a snapshot and requeued itself,
    the second continued from that snapshot and ended where `reference` ends."""
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"job {job}: {info['JobState']} {info['ExitCode']} Restarts={info['Restarts']}\n" \
        f"{text}{cluster.logs()}"
    assert text.count(f"job {job}: 2 node(s) x 1 process(es)") == 2, text  # the script ran twice
    # the second run on another port: the first run's connections may still hold its own
    ports = re.findall(rf"job {job}: 2 node\(s\) x 1 process\(es\), \S+ [^:]+:(\d+)", text)
    assert len(ports) == 2 and ports[0] != ports[1], text
    lines = [ln for ln in text.splitlines() if "preempted:" in ln]
    assert len(lines) == 1, text  # global rank 0 says it, once
    step, epoch, path = PREEMPTED.search(lines[0]).groups()
    assert path == str(ckpt) and int(step) > 0, lines[0]  # stopped in the middle of an epoch
    assert f"job {job}: stopped early by SLURM; requeued to continue from {ckpt}" in text, text
    assert f"loaded {ckpt}: {int(epoch) - 1} epoch(s) + {step} step(s) trained" in text, text
    assert [r["epoch"] for r in read_metrics(jobdir / "m.jsonl")] == [1, 2]
    assert_same_training_state(reference, load(ckpt))
    return text


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_batch_file_on_two_nodes(slurm_cluster, tiny_mnist, tmp_path, never_interrupted, launcher):
    """Two submissions of the same file. (1) SLURM's warning before the time limit
    (`#SBATCH --signal=B:USR1@120`), delivered as SLURM delivers it, to the batch shell only:
    the script passes SIGTERM to the training, which saves a snapshot on the shared disk where
    all processes stop; the script requeues the job; SLURM starts the same job id again (the
    test cluster's BeginTime delay is 6 s), which resumes from the snapshot and ends COMPLETED,
    bit-identical to a job never interrupted; one process wrote each run's checkpoints. (2) The
    same submission with --save-on-each-node and the checkpoint on each node's local disk, where
    each node holds a copy of (1)'s snapshot, taken as (1) was requeued: the processes decide
    together to resume, each node writes its own, and both copies equal a run never
    interrupted, bit for bit. (A node without a copy is refused: test_resume_together.py.)
    Why 45 s: two two-node jobs through a real slurmctld, each requeued once (6 s apart)."""
    cluster, shared = slurm_cluster, tmp_path / "runs" / "c.pt"
    for job in ("warned", "each-node"):  # a folder of its own on every node's disk
        for n in NODES:
            (cluster.disks[n] / f"{tmp_path.name}-{job}" / "rec").mkdir(parents=True)
    args = ["--data-dir", tiny_mnist, *STOP_TRAIN, "--metrics", "m.jsonl"]

    # (1) the warning, a snapshot on the shared disk, one writer a run; the requeue resumes it
    start, name = time.monotonic(), f"{tmp_path.name}-warned"
    job, out = submit_until_step(cluster, launcher, tmp_path, stop_env(
        shared, DDP_TEST_STEP_DELAY=STEP_DELAY, DDP_TEST_RECORD=cluster.local_disk / name / "rec"),
        args)
    r = cluster.client("scancel", "--signal=USR1", "--batch", job)
    assert r.returncode == 0, r.stderr
    requeued = f"job {job}: stopped early by SLURM; requeued to continue from {shared}"
    deadline = time.monotonic() + JOB_TIMEOUT
    while requeued not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    snapshot = load(shared)  # what (2) starts from: a copy on each node's own disk, as
    for n in NODES:  # docs/clusters.md says to make, before the requeued run writes again
        shutil.copy(shared, cluster.disks[n] / f"{tmp_path.name}-each-node" / "c.pt")
    text = check_stopped_and_requeued(cluster, job, out, shared, tmp_path, never_interrupted)
    assert f"job {job}: warning from SLURM (USR1): stopping the training" in text
    assert "2 processes (2 node(s) x 1)" in text  # global rank 0's line
    rows = read_metrics(tmp_path / "m.jsonl")  # written by global rank 0, in the job's cwd
    assert [(r["epoch"], r["world_size"], r["total"]) for r in rows] == [(1, 2, N_TEST),
                                                                          (2, 2, N_TEST)]
    writers = sorted(len({s["pid"] for s in saves if s["path"].startswith(str(shared))})
                     for saves in node_records(cluster, name, "save").values())
    assert writers == [0, 2], writers  # rank 0's node: its one process in each of the two runs
    assert sorted(p.name for p in shared.parent.iterdir()) == ["c.pt"]  # no temp file left
    print(f"{launcher} warned and requeued: {time.monotonic() - start:.1f}s")

    # (2) no shared disk for checkpoints: one writer per node, each into its own directory
    name = f"{tmp_path.name}-each-node"
    local = cluster.local_disk / name / "c.pt"  # the same path, each node its own
    env = stop_env(local, DDP_TEST_RECORD=cluster.local_disk / name / "rec")
    out = submit_and_wait(cluster, launcher, tmp_path, env, [*args, "--save-on-each-node"])
    position = f"{snapshot['epoch']} epoch(s) + {snapshot['step']} step(s)"
    assert snapshot["step"] > 0 and f"loaded {local}: {position} trained" in out, out
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(tmp_path / "m.jsonl")][2:] == \
        [(1, 2), (2, 2)], out
    writers = check_job(cluster, name, local)
    assert all(len(writers[n]) == 1 for n in NODES), writers  # one writer on each node
    for n in NODES:
        assert_same_training_state(never_interrupted, load(cluster.disks[n] / name / "c.pt"))


def test_preempted_job_requeues_itself(slurm_cluster, tiny_mnist, tmp_path, never_interrupted):
    """A job of the partition `urgent` preempts a running job of `debug` (PreemptMode=REQUEUE,
    GraceTime=60, no preempt_send_user_signal): SLURM sends SIGTERM to the job's steps only,
    not to the batch shell. The training stops with a snapshot, and the batch script, seeing a
    PreemptTime in the job's record, requeues the job. (SLURM itself would not: a job whose
    batch script ends within the grace time ends FAILED.) The urgent job runs, then ours
    continues from the snapshot."""
    cluster, ckpt = slurm_cluster, tmp_path / "c.pt"
    start = time.monotonic()
    job, out = submit_until_step(cluster, "torchrun", tmp_path,
                                 stop_env(ckpt, DDP_TEST_STEP_DELAY=STEP_DELAY),
                                 ["--data-dir", tiny_mnist, *STOP_TRAIN, "--metrics", "m.jsonl"])
    r = cluster.client("sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                       f"--output={tmp_path}/urgent-%j.out", "--wrap", "true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    urgent = r.stdout.strip().split(";")[0]
    text = check_stopped_and_requeued(cluster, job, out, ckpt, tmp_path, never_interrupted)
    assert "warning from SLURM" not in text  # the preemption, not the warning
    urgent_info = cluster.wait(urgent, timeout=JOB_TIMEOUT)
    assert urgent_info["JobState"] == "COMPLETED"
    assert urgent_info["StartTime"] <= cluster.job(job)["StartTime"]  # it ran in between
    print(f"preempted and requeued: {time.monotonic() - start:.1f}s")


def test_failing_job_is_not_requeued(slurm_cluster, tiny_mnist, tmp_path):
    """A job that fails for its own reasons (here a global batch that the world size does not
    divide) ends FAILED and is not requeued. Its exit code is 2 (the launcher's), or 143 when
    srun has stopped the other node's launcher first (--kill-on-bad-exit)."""
    job = slurm_cluster.sbatch(BATCH["spawn"], "--data-dir", str(tiny_mnist), "--batch-size", "33",
                               env=stop_env(tmp_path / "c.pt"), cwd=tmp_path)
    info = slurm_cluster.wait(job, timeout=JOB_TIMEOUT)
    out = (tmp_path / f"mnist-spawn-{job}.out").read_text()
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0"), out
    assert info["ExitCode"] in ("2:0", "143:0"), info["ExitCode"]
    assert "must divide by the world size 2" in out and "requeued" not in out, out


def test_srun_without_torchrun_is_refused(slurm_cluster, tiny_mnist, tmp_path):
    """`srun python torchrun_ddp.py` on two nodes: each task sees SLURM's variables but no
    RANK, and would train alone, both over one checkpoint. Each refuses in one line that says
    how to launch instead; nothing is written."""
    ckpt = tmp_path / "c.pt"
    r = slurm_cluster.client(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/%j.out",
        "--wrap", f"srun {sys.executable} {ROOT / 'torchrun_ddp.py'} --data-dir {tiny_mnist} "
        f"--checkpoint {ckpt}", env=script_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    info = slurm_cluster.wait(job, timeout=JOB_TIMEOUT)
    out = (tmp_path / f"{job}.out").read_text()
    assert info["JobState"] == "FAILED", out
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("srun: ")]
    assert lines == ["error: srun started 2 tasks of this script without torchrun, and each "
                     "would train alone: run torchrun on each node (srun --ntasks-per-node=1 "
                     "torchrun ..., as slurm/torchrun_ddp.sbatch does), or spawn_ddp.py"] * 2, out
    assert not ckpt.exists()
