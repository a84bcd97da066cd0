"""docs/your-own-task.md's first task as it ships: tasks/cifar10.py (torchvision's ResNet-18 on
CIFAR-10-shaped images, RandomCrop + RandomHorizontalFlip), given with --task, run with --dummy
(torchvision's FakeData, made here: no download) and 2 data workers per process.
Trained by spawn_ddp.py, then through torchrun_ddp.py stopped by SIGTERM to every process of the
job (the workers too) in the middle of an epoch and resumed, it ends bit-identical to the run
never interrupted. (Each launcher's stop and resume with MNIST: test_preemption.py; with the
tasks of test_other_tasks.py, one launcher each.)"""
import sys

import pytest

from conftest import ROOT, assert_same_training_state, load, run_script, script_env, \
    sigterm_when


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
# 512 FakeData images in global batches of 64: 8 steps an epoch
ARGS = ("--task", ROOT / "tasks" / "cifar10.py", "--dummy", "--workers", 2, "--batch-size", 64,
        "--epochs", 2, "--log-interval", 1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("straight") / "c.pt"
    r = run_script("spawn_ddp.py", *ARGS, "--nproc-per-node", 2, "--checkpoint", ckpt,
                   cwd=ckpt.parent, timeout=300)
    assert "LR 0.1 at batch 256 -> 0.025 at 64 (linear rule, for SGD)" in r.stdout  # its defaults
    return load(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ddp.py"])
def test_stopped_by_sigterm_and_resumed_bit_identical(uninterrupted, tmp_path, script):
    ckpt = tmp_path / "c.pt"
    launch = [*TORCHRUN, str(ROOT / script)] if script == "torchrun_ddp.py" else \
        [str(ROOT / script), "--nproc-per-node", "2"]
    cmd = [sys.executable, *launch, *map(str, ARGS), "--checkpoint", str(ckpt)]
    # steps slowed (same results) so that the signal lands in the middle of epoch 1
    err = sigterm_when(cmd, "epoch 1/2 step 3/", script_env(DDP_TEST_STEP_DELAY=0.2),
                       cwd=tmp_path).stderr
    assert "DataLoader worker" not in err, err
    [line] = [ln for ln in err.splitlines() if "preempted:" in ln]
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 3 <= snap["step"] < 8, line  # in the middle of epoch 1
    r = run_script(script, *ARGS, "--checkpoint", ckpt,
                   *(["--resume"] if script == "spawn_ddp.py" else []),
                   *(["--nproc-per-node", 2] if script == "spawn_ddp.py" else []),
                   launcher=TORCHRUN if script == "torchrun_ddp.py" else (), cwd=tmp_path,
                   timeout=300)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    assert_same_training_state(uninterrupted, load(ckpt))
