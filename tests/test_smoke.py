"""Every launch style trains, stops on SIGTERM, resumes bit for bit and evaluates, on gloo: the
scripts' core promises, checked on one run per script (the quick loop's, docs/maintainers.md),
and what CI's second environment runs with the oldest torch supported (.ci/run).

Each script's run (conftest.preempted) gets SIGTERM in every process, data workers too, in the
middle of epoch 1, and the same command continues from the snapshot to where a run nothing
interrupted ends (conftest.straight), bit for bit: torchrun_ddp.py's at the same world size
and --accumulate (2 for spawn_ddp.py, torchrun_ddp.py and torchrun_fsdp.py, where a reduction
outside a step's last micro-batch would show; apex_ddp.py by its native path at its default O1,
fp32 on these CPUs), dp_baseline.py's in one process. On the same runs: shards, the averaged
loss, every test sample counted once by the saved model and its BatchNorm statistics, one
gradient reduction a step, one writer of whole checkpoints that load weights-only, equal
replicas. Evaluation counts the same at 1, 2 and 3 processes; the lesson pair trains."""
import json
import os
import re
from collections import Counter, defaultdict

import pytest
import torch

import common
from conftest import N_TEST, N_TRAIN, PREEMPTED, STEP_DELAY, UNDER_TORCHRUN, \
    assert_same_training_state, correct_of, final, kept, load, our_frames, read_metrics, \
    read_records, read_tensorboard, run_script
from ddpkit.sigterm import AGREE_EVERY

FSDP2 = torch.__version__ >= (2, 7)  # FSDP2 on a CPU
FSDP = pytest.param("torchrun_fsdp.py", marks=pytest.mark.skipif(
    not FSDP2, reason="FSDP2 on a CPU needs torch 2.7 (test_fsdp_names_the_torch_it_needs)"))
CORE = ["spawn_ddp.py", "torchrun_ddp.py", FSDP]  # the quick loop's (docs/maintainers.md)
EVERY = [*CORE, pytest.param("apex_ddp.py", marks=pytest.mark.slow), "dp_baseline.py"]
ONE = [*CORE, "dp_baseline.py"]  # the claims a run of one process shows too


def checkpoint_of(d):
    return d / "snap" if (d / "snap").exists() else d / "c.pt"


@pytest.mark.parametrize("script", EVERY)
def test_sigterm_saves_where_all_stop_and_resume_is_bit_identical(preempted, straight, script):
    """Every process finishes its step, all agree on one step to stop at, the writer saves a
    snapshot there, and the run ends with one `preempted:` line and exit code 143 in every
    process (torchrun's agent: 1, a crashed worker's too, so its SignalException and each
    worker's recorded exit code tell them apart); no data worker dies of the signal. The stop
    comes at the first agreement after the signal: within AGREE_EVERY seconds of steps that take
    STEP_DELAY at least. The same command (with --resume where the script does not resume by
    itself) loads the snapshot and ends where the straight run ends, bit for bit, the loss
    falling. Both end by themselves though each process keeps an idle thread-pool worker.
    Under torchrun, the script says which restart it is and keeps the one thread a process
    that torchrun sets where nobody asked for another."""
    d = preempted(script)
    r, snap = kept(d, "stopped"), json.loads((d / "snapshot.json").read_text())
    torchrun = script in UNDER_TORCHRUN
    if torchrun:
        assert "1 thread(s) each, restart 0 (TORCHELASTIC_RESTART_COUNT)" in r.stdout, r.stdout
        assert "got signal: 15" in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    assert "DataLoader worker" not in r.stderr, r.stderr
    assert r.returncode == (1 if torchrun else 143), f"{r.stdout}\n{r.stderr}"
    ends = {e["rank"]: e["code"] for e in read_records(d / "rec1", "exit")}  # each one's last
    assert ends == ({} if script == "dp_baseline.py" else {0: 143, 1: 143}), ends
    lines = [ln for ln in r.stderr.splitlines() if "preempted:" in ln]
    assert len(lines) == 1, r.stderr  # rank 0 says it, once
    came = [e["steps"] for e in read_records(d / "rec1", "sigterm")]  # steps begun, per process
    assert snap["epoch"] == 0 and came, (snap, came)  # in the middle of epoch 1
    assert min(came) <= snap["step"] <= max(came) + AGREE_EVERY / STEP_DELAY + 1, (snap, came)
    ckpt = checkpoint_of(d)
    again = "the same command continues from it" if torchrun else "rerun with --resume"
    assert f"after step {snap['step']} of epoch 1; snapshot in {ckpt}: {again}" in lines[0]
    assert "error" not in r.stderr.replace("Traceback", "").lower() or torchrun, r.stderr
    assert not our_frames(r.stderr), r.stderr  # no traceback from our code
    assert [re.sub("[0-9a-f]{8}$", "X", n) for n in snap["left"]] == \
        [ckpt.name] + ["snap.X"] * ckpt.is_dir()  # no temporary file
    resumed = kept(d, "resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert f"loaded {ckpt}: 0 epoch(s) + {snap['step']} step(s) trained" in resumed.stdout
    rows = read_metrics(d / "m.jsonl")
    assert [row["epoch"] for row in rows] == [1, 2]
    [first] = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("epoch 1/2 step 1/")]
    assert first[-1] == "samples/s" and rows[1]["train_loss"] < float(first[5]) / 2, first
    nproc, accumulate = PREEMPTED[script][1]
    assert_same_training_state(load(straight(nproc, accumulate=accumulate) / "c.pt"), final(d))


@pytest.mark.parametrize("script", EVERY)
def test_tensorboard_shows_one_curve_across_the_stop_with_the_numbers_of_metrics(preempted,
                                                                                straight, script):
    """--tensorboard in the stopped run and the resumed one: rank 0 alone writes (an event file
    per run); TensorBoard reads the averaged loss of every global step once, in order, as each
    run printed it; each epoch's numbers are those of --metrics, at its last step; the last
    epoch's test accuracy is the straight run's. (The purge of steps written after a snapshot:
    test_common.py, and test_fsdp.py's restart after a killed worker.)"""
    d = preempted(script)
    assert len(list((d / "tb").glob("events.out.tfevents.*"))) == 2, list((d / "tb").iterdir())
    curves, steps = read_tensorboard(d / "tb"), -(-N_TRAIN // 32)  # 19
    printed = {}  # (epoch, step): the loss as each run printed it
    for out in (kept(d, "stopped").stdout, kept(d, "resumed").stdout):
        for m in re.finditer(r"^epoch (\d+)/2 step (\d+)/\d+ loss (\S+)", out, re.M):
            printed[(int(m[1]) - 1) * steps + int(m[2])] = float(m[3])
    loss = curves["step/train_loss"]
    assert [s for s, _ in loss] == list(range(1, 2 * steps + 1)) == sorted(printed), loss
    assert all(round(v, 4) == pytest.approx(printed[s], abs=1e-4) for s, v in loss), loss
    rows = read_metrics(d / "m.jsonl")
    for key in ("train_loss", "test_acc", "samples_per_s", "data_wait"):
        assert curves[f"epoch/{key}"] == [(steps * row["epoch"], as_float32(row[key]))
                                          for row in rows], key
    nproc, accumulate = PREEMPTED[script][1]
    [*_, last] = read_metrics(straight(nproc, accumulate=accumulate) / "m.jsonl")
    assert curves["epoch/test_acc"][-1][1] == as_float32(last["test_acc"])


def as_float32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def by_rank(rows, key):
    out = defaultdict(list)
    for row in rows:
        out[row["rank"]].append(row[key])
    return out


@pytest.mark.parametrize("script", ONE)
def test_each_process_trains_its_own_shard_in_a_new_order_each_epoch(preempted, script):
    """The training sampler's order as each process drew it (tests/instrument): in every epoch
    the shards (two; dp_baseline.py's one process: the whole set) are disjoint and cover the
    data; epoch 2's order is not epoch 1's; and the resumed run drew epoch 1 in the order the
    stopped run had (its sampler then skips what was trained)."""
    d = preempted(script)
    ranks = list(range(PREEMPTED[script][1][0]))
    stopped, resumed = (by_rank(read_records(d / rec, "sampler"), "indices")
                        for rec in ("rec1", "rec"))
    assert sorted(resumed) == ranks and all(len(v) == 2 for v in resumed.values()), resumed
    for epoch in (0, 1):
        shards = [resumed[rank][epoch] for rank in ranks]
        assert [len(shard) for shard in shards] == [N_TRAIN // len(ranks)] * len(ranks)
        assert sorted(sum(shards, [])) == list(range(N_TRAIN))  # disjoint and complete
    assert resumed[0][0] != resumed[0][1]  # set_epoch: a new order
    assert [stopped[rank][0] for rank in ranks] == [resumed[rank][0] for rank in ranks]


@pytest.mark.parametrize("script", ONE)
def test_the_loss_is_averaged_over_all_processes(preempted, script):
    """Epoch 2's train_loss is the mean of every process's training losses, weighted by their
    samples, as each process computed them (F.cross_entropy, recorded): 19 steps of 2
    micro-batches in each process (dp_baseline.py: 19 steps of one). A loss of one process
    alone would differ, and so would a mean of steps or a sum."""
    d = preempted(script)
    nproc, accumulate = PREEMPTED[script][1]
    ranks, steps = list(range(nproc)), 19 * accumulate
    rows = by_rank(read_records(d / "rec", "loss"), "loss")
    sizes = by_rank(read_records(d / "rec", "loss"), "n")
    assert sorted(rows) == ranks
    total = sum(loss * n for r in ranks for loss, n in zip(rows[r][-steps:], sizes[r][-steps:]))
    seen = [sum(sizes[r][-steps:]) for r in ranks]
    assert seen == [N_TRAIN // nproc] * nproc, seen
    train_loss = read_metrics(d / "m.jsonl")[-1]["train_loss"]
    assert abs(train_loss - total / sum(seen)) < 1e-5 * train_loss, (train_loss, total / sum(seen))
    alone = sum(loss * n for loss, n in zip(rows[0][-steps:], sizes[0][-steps:])) / seen[0]
    assert nproc == 1 or abs(alone - train_loss) > 1e-4 * train_loss  # the check can tell


@pytest.mark.parametrize("script", CORE)
def test_every_test_sample_is_counted_once_by_the_saved_model(preempted, tiny_mnist, script):
    """The last evaluation counts the 101 test samples once (each process its unpadded share,
    50 and 51, then summed), and what it counts is what the saved model gets right, with the
    BatchNorm statistics it was saved with (each process updates its own in training): the
    ones every process evaluated with (recorded, as sums)."""
    d = preempted(script)
    *_, last = rows = read_metrics(d / "m.jsonl")
    assert all((r["total"], r["world_size"]) == (N_TEST, 2) for r in rows), rows
    saved = final(d)["model"]
    assert last["correct"] == correct_of(saved, tiny_mnist) > 0, last
    used = {(r["rank"], r["features"]): r["sums"] for r in read_records(d / "rec", "bn")}
    assert used == {(rank, len(saved[f"features.{i}.running_mean"])): [saved[
        f"features.{i}.running_{s}"].sum().item() for s in ("mean", "var")]
        for rank in (0, 1) for i in (1, 5)}, used


@pytest.mark.parametrize("script", CORE)
def test_one_gradient_reduction_per_optimizer_step(preempted, script):
    """DDP all-reduces each gradient bucket, FSDP reduce-scatters each unit's gradients, once per
    optimizer step: after the step's last micro-batch (--accumulate 2), never after an earlier
    one (a forward or backward outside no_sync, or with FSDP's gradient sync on). The same
    number in every step and every process."""
    d = preempted(script)
    events = by_rank(read_records(d / "rec", "allreduce"), "event")
    assert sorted(events) == [0, 1]
    per_step = {}
    for rank, seq in events.items():  # each step's events (DCP's restore steps once, bare)
        steps = [step.split() for step in " ".join(seq).split("step")[:-1] if step.split()]
        assert len(steps) == 19 * 2 - json.loads((d / "snapshot.json").read_text())["step"]
        for step in steps:
            losses = [i for i, e in enumerate(step) if e == "loss"]
            reductions = [i for i, e in enumerate(step) if e != "loss"]
            assert len(losses) == 2 and reductions and min(reductions) > max(losses), step
        per_step[rank] = {len(step) - 2 for step in steps}
    assert per_step[0] == per_step[1] and len(per_step[0]) == 1, per_step


@pytest.mark.parametrize("script", CORE)
def test_one_process_writes_whole_checkpoints_that_load_weights_only(preempted, script):
    """One process wrote every save (the file), or each process its shards (torchrun_fsdp.py's
    DCP folder, behind a link replaced once all have written); nothing temporary is left; the
    file loads with weights_only=True, and its model, with plain keys, into common.Net strictly;
    and it holds what a run continues from."""
    d = preempted(script)
    ckpt = checkpoint_of(d)
    if ckpt.is_dir():  # the link and the folder it points to, the older deleted; a shard file
        assert ckpt.is_symlink() and sorted(  # per process, each about half
            p.name for p in d.iterdir() if p.name.split(".")[0] == "snap") == \
            ["snap", os.readlink(ckpt)] and re.fullmatch(r"snap\.[0-9a-f]{8}", os.readlink(ckpt))
        shards = [p.stat().st_size for p in ckpt.glob("*.distcp")]
        assert len(shards) == 2 and max(shards) < 0.6 * sum(shards), shards
        state = final(d)  # as torch's converter makes it one file
    else:
        for rec, n in (("rec1", 1), ("rec", 2)):  # the SIGTERM's snapshot; each epoch's end
            saves = [s for s in read_records(d / rec, "save") if s["path"].startswith(str(ckpt))]
            assert len(saves) == n and len({s["pid"] for s in saves}) == 1, saves
        assert sorted(p.name for p in d.glob("c.pt*")) == ["c.pt"]
        state = torch.load(ckpt, weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    common.Net().load_state_dict(state["model"])  # strict
    assert {"optimizer", "scheduler", "scaler", "epoch", "step", "args"} <= state.keys()
    assert (state["epoch"], state["step"], state["args"]["batch_size"]) == (2, 0, 32)


@pytest.mark.parametrize("script", [*CORE[:2], *EVERY[3:]])  # the file form
def test_each_process_reads_the_checkpoint_once(preempted, script):
    """The resumed run: each training process reads the snapshot once, under every launcher
    (torchrun's and dp_baseline.py's read it to check it before they meet, and resume from that
    read); spawn_ddp.py's launcher reads it for its check, and each of its processes once."""
    d = preempted(script)
    reads = Counter(r["pid"] for r in read_records(d / "rec", "load")
                    if r["path"] == str(d / "c.pt"))
    nproc = PREEMPTED[script][1][0]
    assert sorted(reads.values()) == [1] * (nproc + (script == "spawn_ddp.py")), reads


@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_the_replicas_end_identical(preempted, script):
    """Every process ends with the same parameters and BatchNorm buffers (recorded as each
    process left its group), and the checkpoint holds exactly that model."""
    d = preempted(script)
    states = [load(d / "rec" / f"final-rank{r}.pt") for r in (0, 1)]
    saved = final(d)["model"]
    assert states[0].keys() == states[1].keys() == saved.keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]) and torch.equal(saved[k], states[0][k]), k


def test_every_process_steps_with_the_lr_it_says(straight):
    """A 2-process run of conftest.straight (global batch 32, --lr 0.01, the square-root rule):
    every process's optimizer steps with the same LR at each step (recorded), warming up to the
    peak the rule gives, which rank 0 prints (the rule at other batches:
    test_peak_lr_follows_the_rule)."""
    d = straight(2, accumulate=2)
    lrs = by_rank(read_records(d / "rec", "lr"), "lr")
    assert sorted(lrs) == [0, 1] and lrs[0] == lrs[1] and len(lrs[0]) == 38
    peak = 0.01 * (32 / 256) ** 0.5
    assert max(lrs[0]) == pytest.approx(peak, rel=1e-12) and lrs[0][0] < peak
    assert f"LR 0.01 at batch 256 -> {peak:.4g} at 32 (square-root rule, for Adam)" in \
        kept(d, "run").stdout


@pytest.mark.slow
@pytest.mark.parametrize("script,nproc", [("spawn_ddp.py", 3), ("dp_baseline.py", 1)])
def test_evaluation_counts_the_same_at_any_world_size(tiny_mnist, tmp_path, straight, script,
                                                      nproc):
    """The 2-process run's checkpoint evaluated by 3 processes and by 1, at another --batch-size
    and --seed (--evaluate compares nothing of the run): the count of the run's own last
    evaluation, every test sample once; the checkpoint is not written."""
    ref = straight(2) / "c.pt"
    before = ref.read_bytes()
    run_script(script, "--data-dir", tiny_mnist, "--batch-size", 96, "--seed", 3, "--evaluate",
               "--checkpoint", ref, "--metrics", tmp_path / "m.jsonl", nproc=nproc)
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["evaluate"] and row["epoch"] == 2
    assert row["total"] == N_TEST and row["world_size"] == nproc
    assert row["correct"] == read_metrics(ref.parent / "m.jsonl")[-1]["correct"]
    assert ref.read_bytes() == before


@pytest.mark.slow
def test_spawn_resumes_to_the_one_process_run(tiny_mnist, tmp_path, straight):
    """DDP at world size 1 is the bare loop: spawn_ddp.py with one process, stopped after epoch
    1, and dp_baseline.py resuming its checkpoint, end with dp_baseline.py's straight model, bit
    for bit: the same training, and checkpoints the scripts share."""
    ckpt = tmp_path / "c.pt"
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 1, "--batch-size",
               32, "--epochs", 2, "--stop-after", 1, "--checkpoint", ckpt)
    assert load(ckpt)["epoch"] == 1
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--batch-size", 32, "--epochs", 2,
                   "--resume", "--checkpoint", ckpt)
    assert f"loaded {ckpt}: 1 epoch(s) + 0 step(s)" in r.stdout
    assert_same_training_state(load(straight(1) / "c.pt"), load(ckpt))


@pytest.mark.parametrize("name", ["one_process", "ddp"])
def test_the_lesson_trains(lesson_run, name):
    """The README's lesson pair, on the torch at hand (tests/test_lesson.py checks it closely)."""
    d = lesson_run(name)
    assert f"total {N_TEST}" in kept(d, "run").stdout and load(d / "c.pt")["epoch"] == 2


@pytest.mark.skipif(FSDP2, reason="this torch has FSDP2 on a CPU: the tests above run it")
def test_fsdp_names_the_torch_it_needs(tiny_mnist, tmp_path):
    """torchrun_fsdp.py on a torch before 2.7: one line naming the torch it needs, exit code 2."""
    r = run_script("torchrun_fsdp.py", "--data-dir", tiny_mnist, "--checkpoint", tmp_path / "s",
                   check=False)
    assert r.returncode == 2 and r.stderr.strip() == "error: torchrun_fsdp.py needs torch " \
        f"2.7 or later (FSDP2 on a CPU); this is torch {torch.__version__}", r.stderr
