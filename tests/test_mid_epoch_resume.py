"""--save-every in the scripts without an elastic agent: the whole job is killed in the middle
of an epoch (a preempted machine), then `--resume` continues from the snapshot's step and ends
exactly where an uninterrupted run ends: with data-loading worker processes, and in
spawn_ddp.py with --accumulate 2. (Without workers, from a SIGTERM's snapshot: test_smoke.py's
apex_ddp.py run; torchrun_ddp.py resumes by itself: see its tests.)"""
import os
import signal
import sys
import time

import pytest

from conftest import ROOT, assert_same_training_state, load, process_group, run_script, \
    script_env, threads, wait_for

pytestmark = pytest.mark.slow

ARGS = ("--batch-size", 32, "--epochs", 2, "--save-every", 6, "--log-interval", 100)
# 19 steps per epoch; snapshots at steps 6, 12, 18


@pytest.mark.parametrize("script,procs", [("spawn_ddp.py", ["--nproc-per-node", 2, "--timeout", 30,
                                                            "--workers", 2, "--accumulate", 2]),
                                          ("dp_baseline.py", ["--workers", 2])],
                         ids=["spawn-workers2-accumulate2", "dp_baseline-workers2"])
def test_killed_job_resumes_mid_epoch_bit_identical(tiny_mnist, tmp_path, straight, script, procs):
    """The reference: conftest.straight's run of that training (torchrun_ddp.py at 2 processes
    with --accumulate 2, dp_baseline.py in one), which nothing interrupted."""
    args = ["--data-dir", tiny_mnist, *ARGS, *procs]
    one_thread = threads(script)  # as in conftest's straight runs
    reference = (straight(2, accumulate=2) if script == "spawn_ddp.py" else straight(1)) / "c.pt"

    snap = tmp_path / "snap.pt"
    cmd = [sys.executable, str(ROOT / script), *map(str, args), "--checkpoint", str(snap)]
    with process_group(cmd, script_env(DDP_TEST_STEP_DELAY=0.05, **one_thread)) as proc:
        wait_for(snap.exists, 90, "the first snapshot")
        time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # every process of the job, at once
        proc.communicate()
    state = load(snap)
    assert state["epoch"] == 0 and state["step"] > 0  # killed in the middle of the first epoch

    r = run_script(script, *args, "--checkpoint", snap, "--resume", **one_thread)
    assert f"0 epoch(s) + {state['step']} step(s) trained" in r.stdout
    assert_same_training_state(load(reference), load(snap))
