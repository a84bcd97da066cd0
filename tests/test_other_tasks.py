"""Tasks that are not image classification, shipped as files in tasks/ and given by --task:
text classification with dict samples of 5 to 60 tokens, a padding collate and a small
Transformer (tasks/text.py; 512 samples here, a small tensor each), and regression with the
test RMSE as its metric (tasks/regression.py). Each is copied outside the checkout and run
from there, one after the other in the same checkout: each trains through spawn_ddp.py with 2
processes and --workers 2, is stopped by SIGTERM to every process in the middle of an epoch and
resumes bit-identically (text under spawn_ddp.py, regression under torchrun_ddp.py: each
launcher's stop is the same code for any task, test_preemption.py), and --evaluate reports
the task's own metric.
A task given as a module name works the same; a task that does not fit fails in one line,
with its own frames under it, before the first step; the check leaves no trace."""
import re
import shutil
import sys

import pytest

from conftest import ROOT, assert_same_training_state, load, read_metrics, read_records, \
    run_script, script_env, sigterm_when, with_task

pytestmark = pytest.mark.slow

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
TASKS = {  # flags (8 steps an epoch at 2 processes), the metric and what it must reach, and
    # the launcher that stops and resumes it
    "text": (("--samples", 512, "--batch-size", 64), "test_acc", lambda v: v > 40, "spawn_ddp.py"),
    "regression": (("--samples", 1024, "--batch-size", 128), "test_rmse", lambda v: v < 1.2,
                   "torchrun_ddp.py"),
}
COMMON = ("--workers", 2, "--epochs", 2, "--log-interval", 1)
MACHINERY = "checkpoint|data|flags|launch|machine|reporting|_ddp"  # files, less common.py


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """The shipped task files, copied into a folder outside the checkout."""
    folder = tmp_path_factory.mktemp("my-tasks")
    for name in TASKS:
        shutil.copy(ROOT / "tasks" / f"{name}.py", folder / f"{name}.py")
    return folder


@pytest.fixture(scope="module", params=list(TASKS))
def task(request, outside, tmp_path_factory):
    """--task FILE and one run of it that nothing interrupts."""
    flags, metric, good, script = TASKS[request.param]
    flags = ("--task", outside / f"{request.param}.py", *flags)
    out = tmp_path_factory.mktemp(f"{request.param}-straight")
    r = run_script("spawn_ddp.py", *COMMON, *flags, "--checkpoint", out / "c.pt", "--metrics",
                   out / "m.jsonl", cwd=out, timeout=300)
    assert f"task {outside / request.param}.py" in r.stdout.splitlines(), r.stdout
    return flags, metric, good, out, script


def test_trains_and_reports_its_own_metric(task):
    flags, metric, good, out, _ = task
    rows = read_metrics(out / "m.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and good(rows[-1][metric]), rows
    assert not (out / "data").exists()  # MNIST's preparation did nothing for another task
    r = run_script("spawn_ddp.py", *flags, "--checkpoint", out / "c.pt", "--evaluate", cwd=out,
                   timeout=300)
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch 2 evaluate True")]
    assert f"{metric} {rows[-1][metric]:.4g}" in line, (line, rows[-1])


def test_stopped_by_sigterm_and_resumed_bit_identical(task, tmp_path):
    flags, _, _, out, script = task
    ckpt = tmp_path / "c.pt"
    launch = [*TORCHRUN, str(ROOT / script)] if script == "torchrun_ddp.py" else \
        [str(ROOT / script), "--nproc-per-node", "2"]
    cmd = [sys.executable, *launch, *map(str, COMMON + flags), "--checkpoint", str(ckpt)]
    # steps slowed (same results) so that the signal lands in the middle of epoch 1
    _, err = sigterm_when(cmd, "epoch 1/2 step 3/", script_env(DDP_TEST_STEP_DELAY=0.2),
                          cwd=tmp_path)  # to every process, data workers too
    assert "DataLoader worker" not in err, err  # (torchrun's agent prints a traceback of its own)
    assert not re.search(rf'File "[^"]*(common|{MACHINERY})\.py"', err), err
    assert [ln for ln in err.splitlines() if "preempted:" in ln], err
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 3 <= snap["step"] < 8, snap["step"]  # mid-epoch 1
    r = run_script(script, *COMMON, *flags, "--checkpoint", ckpt, "--metrics", tmp_path / "m.jsonl",
                   *(["--resume", "--nproc-per-node", 2] if script == "spawn_ddp.py" else []),
                   launcher=TORCHRUN if script == "torchrun_ddp.py" else (), cwd=tmp_path,
                   timeout=300)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    assert_same_training_state(load(out / "c.pt"), load(ckpt))
    first, second = read_metrics(tmp_path / "m.jsonl")  # the resumed epoch says it is partial
    assert first["partial"] == f"steps {snap['step'] + 1}-8 of 8 (resumed)", first
    assert "partial" not in second


def test_a_task_by_module_name_and_its_flags_in_help(outside, tiny_mnist, tmp_path):
    """--task mypkg.text imports a module from the path; its flags show in --help; a resume
    with another task (or none: MNIST's) is refused by the checkpoint's run, --evaluate names
    the checkpoint's task, and no code the checkpoint names is imported."""
    package = tmp_path / "lib" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(outside / "text.py", package / "text.py")
    lib = [tmp_path / "lib"]
    r = run_script("spawn_ddp.py", "--task", "mypkg.text", "--help", pythonpath=lib)
    assert "--samples" in r.stdout and "--task" in r.stdout, r.stdout
    flags = ("--task", "mypkg.text", "--samples", 256, "--batch-size", 64, "--epochs", 2)
    r = run_script("spawn_ddp.py", *flags, "--stop-after", 1, "--checkpoint", tmp_path / "c.pt",
                   pythonpath=lib)
    assert "task mypkg.text" in r.stdout.splitlines(), r.stdout
    r = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--batch-size", 64, "--epochs", 2,
                   "--checkpoint", tmp_path / "c.pt", "--resume", check=False)
    assert r.returncode == 2 and "--task mypkg.text in the checkpoint, (not given) now" in r.stderr
    for script in ("spawn_ddp.py", "torchrun_ddp.py"):  # (spawn's launcher, torchrun's process)
        r = run_script(script, "--dummy", "--checkpoint", tmp_path / "c.pt", "--evaluate",
                       check=False)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
            f"error: {tmp_path / 'c.pt'} was trained with --task mypkg.text, this run has no "
            "--task (MNIST): evaluate it with --task mypkg.text"), r.stderr


BAD_SHAPE = """
def collate(samples):  # the target as [B, 1], the model's output [B]: they only broadcast
    x, y = torch.utils.data.default_collate(samples)
    return x, y.unsqueeze(1)
"""
SHORT_POSITIONS = """
class Classifier(Classifier):  # position embeddings for 16 tokens; training sequences have 60
    def __init__(self):
        super().__init__()
        self.position = nn.Embedding(16, 32)


def make_model(args):
    return Classifier()
"""


TRAIN_MODE_ONLY = """
class Fails(nn.Module):  # a model that fails in train mode only (a layer of its own, say)
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        if self.training:
            raise RuntimeError("only in train mode")
        return self.net(x)


make_plain_model = make_model


def make_model(args):
    return Fails(make_plain_model(args))
"""


@pytest.mark.parametrize("name,extra,said,frame", [
    ("regression", BAD_SHAPE, "loss_fn(output, target) raised UserWarning: Using a target size "
     "(torch.Size([32, 1])) that is different to the input size (torch.Size([32]))", "loss_fn"),
    ("text", SHORT_POSITIONS, "the model's forward raised IndexError: index out of range in self",
     "forward"),
    ("regression", TRAIN_MODE_ONLY, "the model's forward raised RuntimeError: only in train mode",
     "forward"),
], ids=["target-that-only-broadcasts", "positions-shorter-than-training-sequences",
        "a-model-that-fails-in-train-mode-only"])
def test_a_task_that_does_not_fit_fails_in_one_line_before_training(outside, tmp_path, name,
                                                                     extra, said, frame):
    """The run is the check: each process evaluates a test batch before training (eval mode),
    and its first training step runs the model in train mode and calls loss_fn with warnings
    as errors: one `error:` line per process, before any optimizer step and before anything is
    written, naming the part that failed, with the task's frames under it (its file and line)
    and no "Traceback" header."""
    bad = tmp_path / f"bad_{name}.py"
    bad.write_text((outside / f"{name}.py").read_text() + extra)
    rec = tmp_path / "rec"
    rec.mkdir()
    r = run_script("spawn_ddp.py", "--task", bad, "--samples", 256, "--batch-size", 64,
                   "--log-interval", 1, "--checkpoint", tmp_path / "c.pt", cwd=tmp_path,
                   record=rec, check=False, timeout=300)
    assert not read_records(rec, "lr") and not (tmp_path / "c.pt").exists()
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode != 0 and errors, r.stderr
    assert f"error: the task does not fit the scripts: {said}" in errors[0], errors[0]
    if extra is BAD_SHAPE:
        assert "output [32] and target [32, 1] only broadcast to each other" in errors[0]
    assert f'File "{bad}", line' in r.stderr and f"in {frame}" in r.stderr, r.stderr
    assert not re.search(rf'File "[^"]*({MACHINERY})\.py"', r.stderr), r.stderr
    assert "Traceback" not in r.stderr and "step" not in r.stdout, r.stderr


def test_the_check_leaves_no_trace(tiny_mnist, tmp_path):
    """A task with random augmentation, dropout and BatchNorm (tests/tasks/augment_dropout.py,
    appended to common.py: the way of defining a task before --task, which still works) trains
    the same model with the test batch evaluated before training and without it
    (DDP_TEST_NO_CHECK), in one process (the batch is each process's own)."""
    repo = with_task(tmp_path / "repo",
                     (ROOT / "tests" / "tasks" / "augment_dropout.py").read_text())
    runs = {}
    for name, env in (("with", {}), ("without", {"DDP_TEST_NO_CHECK": 1})):
        run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 1, "--epochs", 1,
                   "--batch-size", 64, "--checkpoint", tmp_path / f"{name}.pt", repo=repo,
                   cwd=tmp_path, timeout=300, **env)
        runs[name] = load(tmp_path / f"{name}.pt")
    assert_same_training_state(runs["without"], runs["with"])
