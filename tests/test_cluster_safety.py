"""What an 8-GPU node would suffer from, seen where a CPU can show it (the rest: test_cuda.py).

- The SIGTERM stop agreement rides on the training backend: no second process group (a gloo
  group beside NCCL opens gloo connections between all ranks, on whatever interface the host
  name resolves to), and one all-reduce of two numbers about once a second, or every step
  where steps are longer.
- The processes meet within --join-timeout, in a round of their own that no key of an
  earlier round can stand for, and the store init_process_group gets then waits --timeout; a
  node that would train with another backend is refused there; --amp auto is one precision
  for the whole job.
- Data workers are forked before the process group starts its threads (a fork while they run
  can hang the child: python/cpython#112275), and share the training process's memory: the
  dataset is neither copied into /dev/shm (a container's default is 64 MB) nor sent over one
  descriptor per tensor ("too many fds" past 256).
- Two writers of one checkpoint path (a shared disk with --save-on-each-node) never share a
  temporary file. (A checkpoint read once per process onto the CPU, and sent in bounded pieces
  to a process without a copy: test_resume_together.py.)"""
import math
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit import checkpoint, data, sigterm
from conftest import ROOT, TORCHRUN2, Watched, agreements, family, free_port, kept, load, \
    process_group, read_metrics, read_records, script_env, spawn_nodes, threads, \
    two_ranks_one_device, with_task

ARGS = ("--batch-size", 32, "--log-interval", 1000)  # 19 steps an epoch on the tiny MNIST
CONV = "torch.nn.modules.conv.Conv2d"


def test_the_stop_agreement_is_about_once_a_second_on_the_training_group(preempted):
    """spawn_ddp.py's shared run (conftest.preempted), resumed with --checkpoint: the processes
    all-reduce a tensor of two numbers (the stop flag and the pace) at an epoch's first and last
    steps and about once a second between: as often in each process, at most 3 + the epoch's
    seconds per epoch; they make no process group. (Steps longer than a second: every step,
    test_slow_steps_still_stop_within_torchruns_grace; without --checkpoint a SIGTERM stops at
    once, no agreement: test_sigterm_without_checkpoint_stops_cleanly.)"""
    d = preempted("spawn_ddp.py")
    assert not read_records(d / "rec", "group")  # no process group but training's
    seconds = [row["epoch_seconds"] for row in read_metrics(d / "m.jsonl")]
    checks = agreements(d / "rec")
    assert set(checks) == {0, 1} and checks[0] == checks[1], checks
    assert 2 * 2 <= checks[0] <= sum(3 + math.ceil(s / sigterm.AGREE_EVERY) for s in seconds)


@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py", pytest.param(
    "apex_ddp.py", marks=pytest.mark.slow)])
def test_init_process_group_gets_a_store_that_waits_the_timeout(preempted, script):
    """The store that init_process_group is given waits --timeout (77 in the shared runs, the
    join timeout 600 by default), as the collectives do: NCCL fetches its unique id through it
    inside that call, so a node still preparing its data when the others are there must not
    fail the start-up (on GPUs: test_cuda.py's late rank). --join-timeout bounds the meeting
    before it (test_missing_peer_fails_within_the_join_timeout). spawn_ddp.py on one machine
    meets in a file; across machines in TCP: test_two_nodes_on_one_machine."""
    inits = read_records(preempted(script) / "rec", "init")
    assert sorted(r["rank"] for r in inits) == [0, 1]
    assert {r["store_timeout"] for r in inits} == {77}, inits


def test_one_precision_for_the_whole_job(preempted):
    """--amp auto: rank 0's CPU computes bfloat16, rank 1's does not (spawn_ddp.py's shared run
    before its stop, tests/instrument). The least capable decides, once, for the whole job:
    both train in fp32 (their modules' outputs are float32), it is said once, and the
    checkpoint records it."""
    d = preempted("spawn_ddp.py")
    said = [ln for ln in kept(d, "stopped").stdout.splitlines() if ln.startswith("precision: ")]
    assert said == ["precision: fp32, as the device of rank(s) 1 has no bfloat16 arithmetic and "
                    "all train in one precision (--amp auto; --amp none: fp32)"], said
    ranks = [r for r in read_records(d / "rec1", "gpu") if r["rank"] is not None]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert f"{CONV} float32" in r["outputs"] and f"{CONV} bfloat16" not in r["outputs"], r
    assert load(d / "c.pt")["args"]["amp"] == "none"


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
    whole dataset into each worker, as they start), seen over the first 30 steps; then SIGTERM
    ends the run (without --checkpoint: at once, exit code 143)."""
    cmd = [sys.executable, str(ROOT / "spawn_ddp.py"), "--dummy", "--workers", "2",
           "--epochs", "1", "--batch-size", "256", "--log-interval", "10"]
    most, seen = 0, 0
    with process_group(cmd, script_env(record=tmp_path), tmp_path) as proc:
        for line in proc.stdout:
            if line.startswith("epoch 1/1 step"):
                most, seen = max([most] + [shm_mapped(p) for p in family(proc.pid)]), seen + 1
                if seen == 3:
                    os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert seen == 3 and proc.returncode == 143, err
    assert most and most < 32 << 20, most  # bytes
    forks = read_records(tmp_path, "fork")
    assert len(forks) >= 2 * (2 + 2)  # 2 processes, each 2 training and 2 test workers
    assert not [f for f in forks if f["group"] or any("gloo" in t for t in f["threads"])], forks


def write_many(path, n):
    for i in range(n):
        checkpoint.save({"model": {"w": torch.full((1000,), float(i))}, "epoch": i}, path)


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
    dataset = [torch.full((3,), float(i)) for i in range(2000)]
    loader = DataLoader(dataset, batch_size=100, num_workers=2, **data.worker_options(2))
    data.start_workers(loader)
    assert sorted(int(x[0]) for batch in loader for x in batch) == list(range(2000))
    control = DataLoader(dataset, batch_size=100, num_workers=2, multiprocessing_context="forkserver")
    with pytest.raises(Exception, match="too many fds"):
        list(control)


RAISES_ON_RANK_1 = '''
import torch.distributed as _dist

_calls, _plain_loss = [0], loss_fn


def loss_fn(output, target):  # a bug that only rank 1 meets, in its third training step
    if torch.is_grad_enabled() and _dist.is_initialized() and _dist.get_rank() == 1:
        _calls[0] += 1
        if _calls[0] == 3:
            raise ValueError("a bug in the task")
    return _plain_loss(output, target)
'''


# A rank that fails ends the job within this many seconds of its line, with default flags
# (docs/clusters.md: measured 2.9 s under spawn and 0.9 s under torchrun, 2-core EPYC, gloo)
FAILED_RANK_ENDS_JOB = 10


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [(), TORCHRUN2], ids=["spawn", "torchrun"])
def test_an_error_in_the_task_is_said_first_and_ends_the_job(tiny_mnist, tmp_path, launcher):
    """Rank 1 raises in the task's loss_fn: its error is the first line, with the task's frame
    (common.py's loss_fn) under it; it leaves the process group, so rank 0, in the step's
    all-reduce, ends at once with one line of its own, not after --timeout (600 s by default):
    the job is over FAILED_RANK_ENDS_JOB seconds after rank 1's line."""
    repo = with_task(tmp_path / "repo", RAISES_ON_RANK_1)
    script = "spawn_ddp.py" if not launcher else "torchrun_ddp.py"
    run = Watched([sys.executable, *launcher, repo / script, "--data-dir", tiny_mnist, *ARGS],
                  script_env(**threads(script)), timeout=120, cwd=tmp_path)
    lines = [ln for _, ln in run.lines if ln.startswith("[rank")]
    assert lines[0] == "[rank 1] error: ValueError: a bug in the task", run.text
    t_error, _ = run.first(r"^\[rank 1\] error: ValueError")
    assert run.returncode != 0 and run.seconds - t_error < FAILED_RANK_ENDS_JOB, run.text
    print(f"the job ended {run.seconds - t_error:.1f} s after rank 1's line")
    frames = run.text.split(lines[0], 1)[1]
    assert f'File "{repo / "common.py"}", line' in frames and "in loss_fn" in frames, run.text
    assert [ln for ln in lines if ln.startswith("[rank 0]")] == lines[1:2], run.text
    assert lines[1].startswith("[rank 0] error: distributed: "), run.text
    if not launcher:
        assert "Traceback" not in run.text, run.text


DATA_FAILS_ON_RANK_1 = '''
import os as _os

_plain_datasets = make_datasets


def make_datasets(args):  # rank 1's node lost its data disk
    if _os.environ.get("RANK") == "1":
        raise OSError(5, "Input/output error", "/data/train.bin")
    return _plain_datasets(args)
'''


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ddp.py", "torchrun_fsdp.py"])
def test_a_node_whose_data_fails_ends_the_job_before_any_joins_the_group(tiny_mnist, tmp_path,
                                                                        script):
    """Two nodes of one process each, with no agent to end the others (a PyTorchJob's pods):
    node 1 cannot read its data. Its own line says why; node 0, whose data loaded, ends at once
    with a line that names rank 1, and neither entered init_process_group, where node 0 would
    have waited --timeout (300 s here) for rank 1."""
    repo, port = with_task(tmp_path / "repo", DATA_FAILS_ON_RANK_1), free_port()
    cmd = [str(c) for c in (sys.executable, repo / script, "--data-dir", tiny_mnist, *ARGS,
                            "--timeout", 300)]
    env = script_env(record=tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2,
                     **threads(script))
    with process_group(cmd, {**env, "RANK": "0"}, tmp_path) as node0:
        node1 = subprocess.run(cmd, env={**env, "RANK": "1"}, cwd=tmp_path, text=True,
                               capture_output=True, timeout=120)
        out, err = node0.communicate(timeout=60)
    assert node1.returncode == 2 and "OSError: [Errno 5] Input/output error" in node1.stderr
    assert node1.stderr.startswith("[rank 1] error: "), node1.stderr
    assert node0.returncode == 1, err
    assert err.splitlines()[-1] == "[rank 0] error: distributed: rank(s) 1 could not load the " \
        "data (their own lines say why)", err
    assert read_records(tmp_path, "init") == []  # nobody joined the group


def test_nothing_of_the_checkpoint_stays_mapped_after_a_resume(preempted):
    """The checkpoint is read mapped (checkpoint.load), and after restore nothing points into
    it: on the CPU the optimizer's state came back as views of the file's pages (Adam's moments
    and steps), which kept it mapped for the whole run (on NFS, the file replaced by the next
    save then lingers as .nfs*). spawn_ddp.py's shared run, resumed: what each process maps as
    it leaves its group."""
    d = preempted("spawn_ddp.py")
    maps = read_records(d / "rec", "maps")
    assert len(maps) == 2 and all(row["files"] for row in maps), maps  # it sees mapped files
    assert [f for row in maps for f in row["files"] if str(d / "c.pt") in f] == []


@pytest.mark.slow
def test_two_ranks_on_one_device_agree_over_gloo(tmp_path):
    """Two ranks on one CPU (conftest.two_ranks_one_device: the fp16 overflow of one rank, the
    stop check, reduce_tensor; test_cuda.py runs it on one GPU, with SyncBatchNorm). Here plain
    BatchNorm's statistics stay each rank's own, as DDP broadcasts no buffers in it: what the
    GPU run's SyncBatchNorm must make equal."""
    rows = two_ranks_one_device("cpu", tmp_path)
    assert rows[0]["bn"] == "BatchNorm2d" and rows[0]["running_mean"] != rows[1]["running_mean"]


def test_the_torchrun_batch_file_gives_its_workers_most_of_the_warning(monkeypatch):
    """slurm/torchrun_ddp.sbatch asks SLURM for a warning N s before the time limit, and gives
    torchrun's shutdown (the wait after it passes SIGTERM on, before SIGKILL) more than its 30 s
    default and less than N, through PET_SHUTDOWN_TIMEOUT, the variable torchrun reads for
    --shutdown-timeout (torch 2.15; older releases ignore it)."""
    import re
    text = (ROOT / "slurm" / "torchrun_ddp.sbatch").read_text()
    [lead] = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)", text, re.M)
    [shutdown] = re.findall(r"^export PET_SHUTDOWN_TIMEOUT=\$\{PET_SHUTDOWN_TIMEOUT:-(\d+)\}", text,
                            re.M)
    assert 30 < int(shutdown) < int(lead)
    from torch.distributed.run import get_args_parser
    if any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions):
        monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", shutdown)
        assert get_args_parser().parse_args(["x.py"]).shutdown_timeout == int(shutdown)


@pytest.mark.slow
def test_a_node_that_would_train_on_another_backend_is_refused_at_the_meeting(tiny_mnist,
                                                                               tmp_path):
    """Two spawn_ddp.py nodes; node 0 has its GPU, node 1 does not see one (its driver down:
    gloo on the CPU). NCCL and gloo over one store would wait out --timeout; the meeting
    refuses the job instead, in one line per node that names node 1, before anything trains.
    (Node 0's GPU is said by tests/instrument: this machine has none.)"""
    rs = spawn_nodes(lambda n: ["--data-dir", tiny_mnist, *ARGS, "--nproc-per-node", 1,
                                "--timeout", 300, "--checkpoint", tmp_path / f"c{n}.pt"],
                     cwd=lambda n: tmp_path, DDP_TEST_BACKEND_OF="0:nccl on cuda")
    said = ("error: the processes of node(s) 1 would train with gloo on cpu, the others with "
            "nccl on cuda: every node must see its GPUs (check its driver with nvidia-smi)")
    for r in rs:
        assert r.returncode != 0, r
        assert [ln for ln in r.stderr.splitlines() if ln.endswith(said)] != [], r.stderr
        assert "Traceback" not in r.stderr and "epoch" not in r.stdout, r
    assert sum(r.stderr.count(said) for r in rs) == 2  # once per node
    assert not list(tmp_path.glob("*.pt"))


def meet_in_threads(store, ranks, join_timeout=5.0, kinds=None):
    """launch.meet for each of `ranks` of a world of 2, each in a thread of its own, on one
    real store: {rank: the PrefixStore it returns, or the exception it raised}."""
    import argparse
    import threading

    from ddpkit import launch
    args = argparse.Namespace(join_timeout=join_timeout, timeout=30.0)
    out = {}

    def one(rank):
        try:
            out[rank] = launch.meet(store, launch.Place(rank, 2, 0, 1, rank), args,
                                    (kinds or {}).get(rank, "gloo on cpu"))
        except Exception as e:
            out[rank] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_the_meeting_takes_no_key_of_an_earlier_round():
    """A store that outlives its round (torchrun's agent's) holds the last rounds' keys: one
    that met ("round" pointing at it, its verdict written) and one that never formed. Rank 1
    may read either before rank 0 opens the new round; it must meet rank 0 under the new
    token, and the two must get the same prefix."""
    import torch.distributed as dist
    store = dist.HashStore()
    store.set("round", "over")
    store.set("over/all", "")
    store.set("never/1", "0 gloo on cpu")
    out = meet_in_threads(store, [1], join_timeout=1.0)  # no rank 0: rank 1 looks, in vain
    assert isinstance(out[1], dist.DistError) and "rank(s) 0 did not come" in str(out[1])
    store.set("round", "never")  # a round whose rank 0 died before it formed
    out = meet_in_threads(store, [0, 1])
    assert all(isinstance(s, dist.PrefixStore) for s in out.values()), out
    out[0].set("key", "from rank 0")
    assert out[1].get("key") == b"from rank 0"  # one prefix: the new round's
    assert store.get("round").decode() not in ("over", "never")


def test_the_meeting_names_who_did_not_come_and_refuses_another_backend():
    import torch.distributed as dist
    out = meet_in_threads(dist.HashStore(), [0], join_timeout=1.0)
    assert str(out[0]) == "rank(s) 1 did not come within --join-timeout 1 s"
    for gpus, lacking in ((0, 1), (1, 0)):  # the node without GPUs named, rank 0's too
        out = meet_in_threads(dist.HashStore(), [0, 1], kinds={gpus: "nccl on cuda"})
        said = f"the processes of node(s) {lacking} would train with gloo on cpu, the others " \
            "with nccl on cuda"
        assert all(str(e).startswith(said) for e in out.values()), out


@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_deterministic_reaches_every_process(preempted, script):
    """--deterministic (conftest.PREEMPTED gives it to these two runs) is in force in every
    training process at every step, before and after the resume: spawn_ddp.py's (new
    interpreters that parsed no flags) and torchrun's (each parses its own): deterministic
    algorithms, cuDNN's deterministic kernels, no benchmark, cuBLAS's workspace. On a CPU they
    train what runs without the flag train (test_smoke compares them with conftest.straight)."""
    d = preempted(script)
    rows = read_records(d / "rec1", "lr") + read_records(d / "rec", "lr")
    assert sorted({r["rank"] for r in rows}) == [0, 1] and len(rows) >= 2 * 2 * 19, len(rows)
    assert all(r["deterministic"] == [True, True, False, ":4096:8"] for r in rows), rows[:2]
