"""The DataLoader path with what real datasets bring: DataLoader worker processes, random
augmentation drawn from torch's global RNG, and a model with dropout. The task
(tests/tasks/augment_dropout.py: MNIST shifted at random by up to 2 pixels (torch's RNG) and
brightened at random (NumPy's), dropout in the head) is appended to a copy of common.py, as docs/your-own-task.md says; it logs every draw
and every dropout mask (with the seed in force) from every process.

What must hold, each checked on the logs of real runs:
- augmentation is drawn per sample from (seed, epoch, index): different on every rank and in
  every epoch, and the same whatever the number of processes or workers;
- dropout draws differently on every rank, and `--nproc-per-node 1 --accumulate 2` draws
  what 2 processes draw;
- a job stopped by SIGTERM sent to all its processes (workers included, as SLURM and torchrun
  send it) saves at the agreed step, and the resume loads nothing for the batches already
  trained, draws what the uninterrupted run drew, and ends bit-identical to it."""
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from ddpkit import data
from conftest import N_TRAIN, ROOT, TORCHRUN2, assert_same_training_state, load, max_rel_diff, \
    run_script, script_env, sigterm_when, with_task

pytestmark = pytest.mark.slow

TASK = (ROOT / "tests" / "tasks" / "augment_dropout.py").read_text()
EPOCHS, BATCH = 2, 32  # 19 steps an epoch on the 600 training images
ARGS = ("--batch-size", BATCH, "--epochs", EPOCHS, "--log-interval", 1, "--timeout", 60)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return with_task(tmp_path_factory.mktemp("augment_dropout"), TASK)


def logs(folder, kind):
    """The rows of every process's log; a data worker's rows get its training process's rank."""
    rows = {}
    for f in sorted(Path(folder).glob("*.jsonl")):
        rows[f.name] = [json.loads(line) for line in f.read_text().splitlines()]
    ranks = {row["pid"]: row["rank"] for r in rows.values() for row in r if row["rank"] is not None}
    out = []
    for name, r in rows.items():
        if name.startswith(kind):
            for row in r:
                if row["rank"] is None:
                    row["rank"] = ranks.get(row["parent"], 0)  # one process: rank 0
                out.append(row)
    return out


def by_sample(folder, seed=0):
    """{(epoch, index): draw} from the draw logs; each seed must be the one for its sample."""
    seeds = {data.mix(seed, e, i): (e, i) for e in range(EPOCHS) for i in range(N_TRAIN)}
    out = {}
    for row in logs(folder, "draws"):
        assert row["seed"] in seeds, row  # seeded per sample from (seed, epoch, index)
        epoch, index = seeds[row["seed"]]
        assert index == row["index"], row
        out.setdefault((epoch, index), []).append(tuple(row["draw"]))
    return out


def train(repo, folder, *extra, launcher=(), **env):
    folder.mkdir(parents=True, exist_ok=True)
    return run_script("spawn_ddp.py" if not launcher else "torchrun_ddp.py", "--data-dir",
                      env.pop("data"), *ARGS, *extra, launcher=launcher, repo=repo,
                      DDP_TEST_TASK_LOG=folder, OMP_NUM_THREADS=1, timeout=300, **env)


@pytest.fixture(scope="module")
def two_processes(repo, tiny_mnist, tmp_path_factory):
    """spawn_ddp.py, 2 processes, 2 data workers each: the logs and the checkpoint."""
    d = tmp_path_factory.mktemp("two")
    train(repo, d / "log", "--nproc-per-node", 2, "--workers", 2, "--checkpoint", d / "c.pt",
          data=tiny_mnist)
    return d


def test_augmentation_differs_per_rank_and_epoch(two_processes):
    draws = by_sample(two_processes / "log")
    assert len(draws) == EPOCHS * N_TRAIN and all(len(v) == 1 for v in draws.values())
    # The trap: with the same RNG on every rank, rank 1's k-th sample got rank 0's k-th draw.
    per_rank = defaultdict(list)
    for row in logs(two_processes / "log", "draws"):
        per_rank[row["rank"]].append(tuple(row["draw"]))
    assert sorted(per_rank) == [0, 1]
    same = sum(a == b for a, b in zip(per_rank[0], per_rank[1]))
    assert same < 0.2 * len(per_rank[0])  # 1 in 25 by chance
    changed = sum(draws[0, i] != draws[1, i] for i in range(N_TRAIN))
    assert changed > 0.8 * N_TRAIN  # another draw for the same image in the next epoch
    numpy_draws = [d[2] for [d] in draws.values()]  # NumPy's: no two samples alike
    assert len(set(numpy_draws)) == len(numpy_draws)


def test_dropout_differs_per_rank(two_processes):
    by_rank = defaultdict(list)
    for row in logs(two_processes / "log", "dropout"):
        by_rank[row["rank"]].append(row["mask"])
    assert len(by_rank[0]) == len(by_rank[1]) == EPOCHS * 19
    assert all(a != b for a, b in zip(by_rank[0], by_rank[1]))  # every step, other masks


@pytest.fixture(scope="module")
def one_process(repo, tiny_mnist, tmp_path_factory):
    """spawn_ddp.py, 1 process accumulating 2 micro-batches, no data workers: the logs and the
    checkpoint."""
    d = tmp_path_factory.mktemp("one")
    train(repo, d / "log", "--nproc-per-node", 1, "--accumulate", 2, "--workers", 0,
          "--checkpoint", d / "c.pt", data=tiny_mnist)
    return d


def test_one_process_accumulating_two_draws_what_two_processes_draw(one_process, two_processes):
    """Augmentation and dropout, with data workers on one side and none on the other: the same
    draws, so the same training up to float rounding (BatchNorm's running statistics aside,
    test_accumulate.py says why)."""
    assert by_sample(one_process / "log") == by_sample(two_processes / "log")
    ones, twos = ({row["seed"]: row["mask"] for row in logs(d, "dropout")}
                  for d in (one_process / "log", two_processes / "log"))
    assert ones == twos  # micro-batch k draws what rank k of 2 processes draws
    a, b = load(one_process / "c.pt")["model"], load(two_processes / "c.pt")["model"]
    trained = [k for k in a if "running_" not in k and "num_batches" not in k]
    assert max_rel_diff({k: a[k] for k in trained}, {k: b[k] for k in trained}) < 1e-4


def test_the_check_leaves_no_trace(repo, tiny_mnist, one_process, tmp_path):
    """The task (random augmentation, dropout, BatchNorm; appended to common.py: the way of
    defining a task before --task, which still works) trains the same model with the test batch
    evaluated before training and without it (DDP_TEST_NO_CHECK): one process, as above (the
    batch is each process's own)."""
    train(repo, tmp_path / "log", "--nproc-per-node", 1, "--accumulate", 2, "--workers", 0,
          "--checkpoint", tmp_path / "c.pt", data=tiny_mnist, DDP_TEST_NO_CHECK=1)
    assert_same_training_state(load(tmp_path / "c.pt"), load(one_process / "c.pt"))


def test_sigterm_to_every_process_with_workers_then_an_exact_resume(repo, tiny_mnist,
                                                                    tmp_path, two_processes):
    """torchrun, 2 processes with 2 data workers each; SIGTERM to every process of the job
    (the workers too, as torchrun's os.killpg and SLURM's scancel send it). It ends where
    spawn_ddp.py's straight run with the same flags ends, with the same draws."""
    straight = two_processes
    ckpt, log = tmp_path / "c.pt", tmp_path / "log"
    log.mkdir()
    cmd = [sys.executable, *TORCHRUN2, str(repo / "torchrun_ddp.py"), "--data-dir",
           str(tiny_mnist), *map(str, ARGS), "--workers", "2", "--checkpoint", str(ckpt)]
    err = sigterm_when(cmd, "epoch 1/2 step 5/", script_env(
        DDP_TEST_STEP_DELAY=0.1, DDP_TEST_TASK_LOG=log, OMP_NUM_THREADS=1), timeout=120).stderr
    assert "DataLoader worker" not in err and "preempted: stopped on SIGTERM" in err, err
    snap = load(ckpt)
    assert snap["epoch"] == 0 and snap["step"] >= 5
    before = {key for key in by_sample(log)}
    resumed = tmp_path / "resumed"
    r = train(repo, resumed, "--workers", 2, "--checkpoint", ckpt, launcher=TORCHRUN2,
              data=tiny_mnist)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    after = by_sample(resumed)
    loaded = [i for e, i in after if e == 0]
    assert len(loaded) == N_TRAIN - snap["step"] * BATCH  # nothing for the batches trained
    reference = by_sample(straight / "log")
    assert all(after[key] == reference[key] for key in after)  # the same augmentation
    assert before | set(after) >= set(reference)
    assert_same_training_state(load(straight / "c.pt"), load(ckpt))
