"""docs/your-own-task.md, followed as written: its recipe block (torchvision's ResNet-18 on
CIFAR-10-shaped images, RandomCrop + RandomHorizontalFlip) appended to a copy of common.py,
run with --dummy (torchvision's FakeData, no download) and 2 data workers per process.
Through torchrun_ddp.py and spawn_ddp.py, each stopped by SIGTERM to every process of the job
(the workers too) in the middle of an epoch and resumed, both end bit-identical to a run never
interrupted."""
import re
import sys

import pytest

from conftest import ROOT, assert_same_training_state, load, run_script, script_env, \
    sigterm_when, with_task


PAGE = ROOT / "docs" / "your-own-task.md"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
# 512 FakeData images in global batches of 64: 8 steps an epoch
ARGS = ("--dummy", "--workers", 2, "--batch-size", 64, "--epochs", 2, "--log-interval", 1)


def recipe():
    """The page's first Python block (CIFAR-10), as written."""
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[0]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return with_task(tmp_path_factory.mktemp("cifar"), recipe())


@pytest.fixture(scope="module")
def uninterrupted(repo, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("straight") / "c.pt"
    r = run_script("spawn_ddp.py", *ARGS, "--nproc-per-node", 2, "--checkpoint", ckpt,
                   repo=repo, timeout=300)
    assert "LR 0.1 at batch 256 -> 0.025 at 64 (linear rule, for SGD)" in r.stdout  # its defaults
    return load(ckpt)


def test_the_page_counts_the_block_right():
    [said] = re.findall(r"That is (\d+) lines", PAGE.read_text())
    assert int(said) == len(recipe().strip().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ddp.py", "spawn_ddp.py"])
def test_stopped_by_sigterm_and_resumed_bit_identical(repo, uninterrupted, tmp_path, script):
    ckpt = tmp_path / "c.pt"
    launch = [*TORCHRUN, str(repo / script)] if script == "torchrun_ddp.py" else \
        [str(repo / script), "--nproc-per-node", "2"]
    cmd = [sys.executable, *launch, *map(str, ARGS), "--checkpoint", str(ckpt)]
    # steps slowed (same results) so that the signal lands before the check at step 7 of 8
    _, err = sigterm_when(cmd, "epoch 1/2 step 3/", script_env(DDP_TEST_STEP_DELAY=0.2))
    assert "DataLoader worker" not in err, err
    [line] = [ln for ln in err.splitlines() if "preempted:" in ln]
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 3 <= snap["step"] < 8, line  # in the middle of epoch 1
    r = run_script(script, *ARGS, "--checkpoint", ckpt,
                   *(["--resume"] if script == "spawn_ddp.py" else []),
                   *(["--nproc-per-node", 2] if script == "spawn_ddp.py" else []),
                   launcher=TORCHRUN if script == "torchrun_ddp.py" else (), repo=repo,
                   timeout=300)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    assert_same_training_state(uninterrupted, load(ckpt))
