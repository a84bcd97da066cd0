"""Tasks that are not image classification, defined through the task's names alone (the table
of docs/your-own-task.md) and appended to a copy of common.py: text classification with dict
samples of 5 to 60 tokens, a padding collate and a small Transformer (tests/tasks/text.py; 512
samples here, a small tensor each), and regression with the test RMSE as its metric (the
page's second recipe, as written). Each trains through torchrun_ddp.py and spawn_ddp.py with 2 processes and
--workers 2, is stopped by SIGTERM to every process in the middle of an epoch and resumes
bit-identically, and --evaluate reports the task's own metric. A task that does not fit fails
in one line before training."""
import re
import sys

import pytest

from conftest import ROOT, assert_same_training_state, load, read_metrics, run_script, \
    script_env, sigterm_when, with_task

pytestmark = pytest.mark.slow

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
PAGE = ROOT / "docs" / "your-own-task.md"


def regression_recipe():
    """The page's second Python block, as written."""
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[1]


TASKS = {  # code, flags (8 steps an epoch at 2 processes), the metric and what it must reach
    "text": (lambda: (ROOT / "tests" / "tasks" / "text.py").read_text(),
             ("--samples", 512, "--batch-size", 64), "test_acc", lambda v: v > 40),
    "regression": (regression_recipe, ("--samples", 1024, "--batch-size", 128), "test_rmse",
                   lambda v: v < 1.2),
}
COMMON = ("--workers", 2, "--epochs", 2, "--log-interval", 1)


@pytest.fixture(scope="module", params=list(TASKS))
def task(request, tmp_path_factory):
    """The task in a copy of the repository, and one run of it that nothing interrupts."""
    code, flags, metric, good = TASKS[request.param]
    repo = with_task(tmp_path_factory.mktemp(request.param), code())
    out = tmp_path_factory.mktemp(f"{request.param}-straight")
    run_script("spawn_ddp.py", *COMMON, *flags, "--checkpoint", out / "c.pt", "--metrics",
               out / "m.jsonl", repo=repo, cwd=out, timeout=300)
    return repo, flags, metric, good, out


def test_trains_and_reports_its_own_metric(task):
    repo, flags, metric, good, out = task
    rows = read_metrics(out / "m.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and good(rows[-1][metric]), rows
    assert not (out / "data").exists()  # MNIST's preparation did nothing for another task
    r = run_script("spawn_ddp.py", *flags, "--checkpoint", out / "c.pt", "--evaluate", repo=repo,
                   cwd=out, timeout=300)
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch 2 evaluate True")]
    assert f"{metric} {rows[-1][metric]:.4g}" in line, (line, rows[-1])


@pytest.mark.parametrize("script", ["torchrun_ddp.py", "spawn_ddp.py"])
def test_stopped_by_sigterm_and_resumed_bit_identical(task, script, tmp_path):
    repo, flags, _, _, out = task
    ckpt = tmp_path / "c.pt"
    launch = [*TORCHRUN, str(repo / script)] if script == "torchrun_ddp.py" else \
        [str(repo / script), "--nproc-per-node", "2"]
    cmd = [sys.executable, *launch, *map(str, COMMON + flags), "--checkpoint", str(ckpt)]
    # steps slowed (same results) so that the signal lands before the check at step 7 of 8
    _, err = sigterm_when(cmd, "epoch 1/2 step 3/", script_env(DDP_TEST_STEP_DELAY=0.2),
                          cwd=tmp_path)  # to every process, data workers too
    assert "DataLoader worker" not in err, err  # (torchrun's agent prints a traceback of its own)
    assert not re.search(r'File "[^"]*(common|harness|resumable|_ddp)\.py"', err), err
    assert [ln for ln in err.splitlines() if "preempted:" in ln], err
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 3 <= snap["step"] < 8, snap["step"]  # mid-epoch 1
    r = run_script(script, *COMMON, *flags, "--checkpoint", ckpt,
                   *(["--resume", "--nproc-per-node", 2] if script == "spawn_ddp.py" else []),
                   launcher=TORCHRUN if script == "torchrun_ddp.py" else (), repo=repo,
                   cwd=tmp_path, timeout=300)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    assert_same_training_state(load(out / "c.pt"), load(ckpt))


def test_a_task_that_does_not_fit_fails_in_one_line_before_training(tmp_path):
    """The regression recipe without its evaluate_batch and summarize: MNIST's evaluate_batch
    takes the argmax of a dimension the output does not have."""
    code = regression_recipe().split("def evaluate_batch")[0]
    repo = with_task(tmp_path / "repo", code)
    r = run_script("spawn_ddp.py", *TASKS["regression"][1], "--log-interval", 1, repo=repo,
                   cwd=tmp_path, check=False, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode != 0 and errors, r.stderr
    assert "evaluate_batch(output, target) failed on two samples with IndexError" in errors[0]
    assert "Traceback" not in r.stderr and "step" not in r.stdout, r.stderr
