"""SIGTERM, the notice a scheduler sends before it kills a job (SLURM at the time limit or on
preemption, then SIGKILL after KillWait; Kubernetes likewise; torchrun when it stops its
workers). Every process finishes the step it is in, they agree on one step to stop at, the
writer saves a snapshot there, and the run ends with a `preempted:` line and exit code 143.
A SIGTERM to every process of the job (what SLURM does), and the resume that ends bit-identical
to a run never interrupted, is each script's shared run (test_smoke.py); here: the signal to
the launcher alone (what a user's `kill PID` does: spawn_ddp.py's launcher and torchrun's agent
pass it on), a run without a checkpoint, steps of 5 s inside torchrun's 30 s grace, and a rank
stuck in a collective."""
import os
import signal
import time

import pytest

from conftest import STEP_DELAY, TRAIN, agreements, command, load, our_frames, \
    process_group, read_records, script_env, session_processes, sigterm_when, threads
from ddpkit.sigterm import AGREE_EVERY

pytestmark = pytest.mark.slow

PREEMPTED = 143


def job(script, tiny_mnist, ckpt=None):
    """`script` at 2 processes (dp_baseline.py: 1) with --timeout 30, 19 steps an epoch."""
    one = script == "dp_baseline.py"
    return command(script, 1 if one else 2, "--data-dir", tiny_mnist, *TRAIN, "--log-interval", 1,
                   *(() if one else ("--timeout", 30)), *(("--checkpoint", ckpt) if ckpt else ()))


def stopped(cmd, alone=False, **env):
    """`cmd`, with steps slowed, given SIGTERM once rank 0 logged step 5: every process of the
    job gets it (as SLURM sends it), or the launcher `alone` (as `kill PID` does)."""
    return sigterm_when(cmd, "epoch 1/2 step 5/", script_env(DDP_TEST_STEP_DELAY=STEP_DELAY,
                                                             **env), alone=alone, timeout=120)


@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_sigterm_to_the_launcher_alone_stops_every_process_at_one_step(tiny_mnist, tmp_path,
                                                                       script):
    """`kill PID` of spawn_ddp.py's launcher or of torchrun's agent: it passes the signal on, and
    the processes stop as they do when each gets it (test_smoke.py's
    test_sigterm_saves_where_all_stop_and_resume_is_bit_identical, which also resumes): one
    `preempted:` line, a snapshot in the middle of epoch 1 where all stopped, no temporary file,
    no traceback of ours; exit code 143 in every process (torchrun's agent: 1, with its
    SignalException, where a crashed worker's is 1 too: the workers' recorded exit codes)."""
    ckpt, rec = tmp_path / "c.pt", tmp_path / "rec"
    rec.mkdir()
    r = stopped(job(script, tiny_mnist, ckpt), alone=True, record=rec, **threads(script))
    torchrun = script == "torchrun_ddp.py"
    assert r.returncode == (1 if torchrun else PREEMPTED), f"{r.stdout}\n{r.stderr}"
    assert "ChildFailedError" not in r.stderr, r.stderr
    assert {e["rank"]: e["code"] for e in read_records(rec, "exit")} == {0: 143, 1: 143}
    lines = [ln for ln in r.stderr.splitlines() if "preempted:" in ln]
    assert len(lines) == 1, r.stderr  # rank 0 says it, once
    snap = load(ckpt)
    came = [e["steps"] for e in read_records(rec, "sigterm")]  # steps begun, per process
    assert snap["epoch"] == 0 and came, (snap, came)  # in epoch 1, at its first agreement after
    assert min(came) <= snap["step"] <= max(came) + AGREE_EVERY / STEP_DELAY + 1, (snap, came)
    again = "the same command continues from it" if torchrun else "rerun with --resume"
    assert f"after step {snap['step']} of epoch 1; snapshot in {ckpt}: {again}" in lines[0]
    assert "error" not in r.stderr.replace("Traceback", "").lower() or torchrun, r.stderr
    assert not our_frames(r.stderr), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "rec"]


def test_sigterm_without_checkpoint_stops_cleanly(tiny_mnist, tmp_path):
    """No --checkpoint: nothing to save, and no stop agreement (its all-reduces, recorded: none),
    but the same clean stop and the same exit code."""
    r = stopped(job("spawn_ddp.py", tiny_mnist), record=tmp_path)
    assert r.returncode == PREEMPTED, r.stderr
    assert "nothing saved (no --checkpoint)" in r.stderr
    assert not our_frames(r.stderr)
    assert read_records(tmp_path, "init") and not agreements(tmp_path)


def test_the_switch_bench_uses_turns_the_check_off(tiny_mnist, tmp_path):
    """Control for docs/speed.md's cost measurement: with DDP_TEST_NO_STOP the same SIGTERM
    changes nothing, the run trains to its end (so the comparison has a real "without"). One
    process: the switch replaces the check itself, as in every script."""
    r = stopped(job("dp_baseline.py", tiny_mnist, tmp_path / "c.pt"), DDP_TEST_NO_STOP=1)
    assert r.returncode == 0 and "preempted" not in r.stderr, r.stderr
    assert "epoch 2 train_loss" in r.stdout


def test_slow_steps_still_stop_within_torchruns_grace(tiny_mnist, tmp_path):
    """Steps of 5 s, and a SIGTERM to torchrun's agent, which passes it on and kills its workers
    30 s later (its --shutdown-timeout). The agreement follows the pace of the steps: the
    processes agree before every step here, as often in each (recorded: the all-reduces of the
    stop flag and the pace), so the stop and its snapshot come a step or two after the signal:
    well inside the 30 s, where an agreement every 10 steps (50 s) lost the snapshot."""
    ckpt = tmp_path / "c.pt"
    env = script_env(record=tmp_path, DDP_TEST_STEP_DELAY=5, **threads("torchrun_ddp.py"))
    with process_group(job("torchrun_ddp.py", tiny_mnist, ckpt), env) as proc:
        for line in proc.stdout:
            if line.startswith("epoch 1/2 step 2/"):
                break
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the agent alone: it passes the signal on
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - signalled
    assert "preempted: stopped on SIGTERM after step" in err, err
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 2 <= snap["step"] <= 5, snap["step"]
    assert took < 25, took  # two steps and the write, not the 30 s torchrun gives
    steps = snap["step"] + 1  # the checks before each step, the last one the stop
    assert agreements(tmp_path) == {0: steps, 1: steps}


def test_a_second_sigterm_to_spawns_launcher_ends_a_rank_stuck_in_a_collective(tiny_mnist,
                                                                                tmp_path):
    """Rank 1 sleeps 60 s before its third step (its own slow work); rank 0 waits for it in a
    collective, where no Python handler runs. A SIGTERM to the launcher reaches both and stops
    neither; a second one kills them: the job ends at once, not at --step-timeout (30 s here)
    or after the sleep, and leaves no process behind."""
    cmd = job("spawn_ddp.py", tiny_mnist, tmp_path / "c.pt")
    env = script_env(DDP_TEST_STALL="1:3:60", **threads("spawn_ddp.py"))
    with process_group(cmd, env) as proc:
        for line in proc.stderr:
            if line.startswith("test instrumentation: rank 1 sleeps 60 s"):
                break
        time.sleep(2)  # rank 0 is in its next collective by now
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as `kill PID` does
        time.sleep(3)
        assert proc.poll() is None  # the first SIGTERM stopped neither
        second = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - second
    assert took < 10 and proc.returncode == 1, (took, err)
    assert "error: killed by SIGKILL" in err, err
    assert not session_processes(proc.pid)  # nothing of the job is left
