"""A checkpoint belongs to its run (checkpoint.check_same_run; docs/preemption.md, "One run, one
checkpoint"). A resume, an elastic restart or a requeue continues only the run that wrote the checkpoint: any
flag that defines the run (checkpoint.NOT_THE_RUN lists those that do not) given another value
is refused in one `error:` line that names each one with both values, before anything is
written, and the checkpoint stays byte for byte as it was. The same command again continues;
another world size is the same run; --evaluate compares nothing. A fresh run (no --resume) of
spawn_ddp.py or dp_baseline.py never overwrites one."""
import pytest

from conftest import TORCHRUN2, TRAIN, read_metrics, run_mains, run_script, spawn_nodes

BASE = (*TRAIN, "--log-interval", 5)  # the flags of conftest.first_epoch's run
RUN = (*BASE, "--accumulate", 2)  # of conftest.straight(2, accumulate=2)'s
CHANGES = [  # another value for a flag that defines the run: what the refusal must say
    (["--batch-size", "64"], "--batch-size 32 in the checkpoint, 64 now"),
    (["--seed", "1"], "--seed 0 in the checkpoint, 1 now"),
    (["--epochs", "3"], "--epochs 2 in the checkpoint, 3 now"),
    (["--lr", "0.02"], "--lr 0.01 in the checkpoint, 0.02 now"),
    (["--accumulate", "1"], "--accumulate 2 in the checkpoint, 1 now"),
    (["--amp", "bf16"], "--amp none in the checkpoint, bf16 now"),
    (["--dummy"], "--dummy now, not in the checkpoint"),  # a task's own flag
]


def resume(script, tiny_mnist, ckpt, *flags):
    return {"argv": ["--data-dir", str(tiny_mnist), *map(str, RUN), "--checkpoint", str(ckpt),
                     "--resume", *flags]}


@pytest.mark.parametrize("script", ["dp_baseline.py", "spawn_ddp.py"])
def test_a_resume_with_other_flags_is_refused_in_one_line(straight, tiny_mnist, script):
    """The launcher refuses before anything starts; then the same command with one thing the
    run does not depend on changed (the data's folder, workers, the log, the world size, the
    timeouts) gets as far as starting. (The checkpoint of a 2-process run, conftest.straight.)"""
    ckpt = straight(2, accumulate=2) / "c.pt"
    before = ckpt.read_bytes()
    same = ["--workers", "1", "--log-interval", "7", "--save-every", "3"]
    if script == "spawn_ddp.py":
        same += ["--nproc-per-node", "4", "--timeout", "100"]
    cases = [resume(script, tiny_mnist, ckpt, *flags) for flags, _ in CHANGES]
    cases.append(resume(script, tiny_mnist, ckpt, "--batch-size", "128", "--seed", "5"))
    cases.append(resume(script, tiny_mnist, ckpt, *same))
    *refused, both, ok = run_mains(script, cases)
    for (flags, said), r in zip(CHANGES, refused):
        assert r["code"] == 2 and not r["started"], (flags, r)
        [line] = r["stderr"].splitlines()
        assert line.startswith(f"error: {ckpt} is the checkpoint of another run: {said}. "), line
        assert line.endswith("or another --checkpoint to start a new run"), line
    [line] = both["stderr"].splitlines()
    assert "--batch-size 32 in the checkpoint, 128 now; --seed 0 in the checkpoint, 5 now." in line
    assert ok["started"] and ok["code"] == 0, ok
    assert ckpt.read_bytes() == before


@pytest.mark.parametrize("script", ["dp_baseline.py", "spawn_ddp.py"])
def test_a_fresh_run_never_overwrites_a_checkpoint(straight, tiny_mnist, script):
    """Without --resume, an existing --checkpoint (this run's or another's) is refused in one
    line that says how to go on, before anything starts; the file stays as it was."""
    ckpt = straight(2, accumulate=2) / "c.pt"
    before = ckpt.read_bytes()
    [r] = run_mains(script, [{"argv": ["--data-dir", str(tiny_mnist), *map(str, RUN),
                                       "--checkpoint", str(ckpt)]}])
    assert r["code"] == 2 and not r["started"], r
    assert r["stderr"].splitlines() == [f"error: --checkpoint {ckpt} exists: add --resume to "
                                        "continue its run, or give another path to start a "
                                        "new one"], r
    assert ckpt.read_bytes() == before


@pytest.mark.slow
def test_torchrun_refuses_a_new_run_at_an_old_path_and_continues_the_same(first_epoch, tiny_mnist,
                                                                           tmp_path):
    """torchrun_ddp.py resumes whenever it finds --checkpoint: a new experiment at the same path
    (another --seed) is refused, by one line, with the file untouched; the first run's own
    command continues it at another world size (1 process, where 2 began). (--evaluate
    compares nothing: test_evaluation_counts_the_same_at_any_world_size.)"""
    ckpt, before = first_epoch, first_epoch.read_bytes()
    flags = ["--data-dir", tiny_mnist, *BASE, "--checkpoint", ckpt, "--timeout", 30]
    r = run_script("torchrun_ddp.py", *flags, "--seed", 7, launcher=TORCHRUN2, check=False)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert lines == [f"[rank 0] error: {ckpt} is the checkpoint of another run: --seed 0 in "
                     "the checkpoint, 7 now. Give its flags to continue it, or another "
                     "--checkpoint to start a new run"], r.stderr
    assert ckpt.read_bytes() == before
    copy = tmp_path / "c.pt"
    copy.write_bytes(before)
    flags[flags.index(ckpt)] = copy
    r = run_script("torchrun_ddp.py", *flags, "--metrics", tmp_path / "m.jsonl")
    assert f"loaded {copy}: 1 epoch(s) + 0 step(s) trained" in r.stdout
    assert [(row["epoch"], row["world_size"]) for row in read_metrics(tmp_path / "m.jsonl")] \
        == [(2, 1)]


@pytest.mark.slow
def test_nodes_started_with_other_flags_are_refused(tiny_mnist, tmp_path):
    """Two spawn_ddp.py nodes given two seeds would train two different programs in one job:
    refused by the first process of each node, before anything is written, exit code 2 (bad
    input) from each launcher, which adds no line of its own."""
    rs = spawn_nodes(lambda n: ["--data-dir", tiny_mnist, *BASE, "--nproc-per-node", 1, "--seed",
                                n, "--timeout", 30, "--checkpoint", tmp_path / f"c{n}.pt"],
                     cwd=lambda n: tmp_path)
    assert [r.returncode for r in rs] == [2, 2], rs
    for r in rs:
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "were started with other flags than rank 0's; give every node the same " \
               "command" in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.pt"))
