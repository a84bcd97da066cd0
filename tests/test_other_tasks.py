"""Tasks that are not MNIST, shipped as files in tasks/ and given by --task: text
classification with dict samples of 5 to 60 tokens, a padding collate and a small Transformer
(tasks/text.py; 512 samples here, a small tensor each), regression with the test RMSE as its
metric (tasks/regression.py), and docs/your-own-task.md's first, torchvision's ResNet-18 on
CIFAR-10-shaped images with RandomCrop and RandomHorizontalFlip (tasks/cifar10.py, with
--dummy: torchvision's FakeData, no download). Each is copied outside the checkout and run from
there (conftest.task_run, shared with test_fsdp.py), the text task as a module of a package
(--task mypkg.text), the others as files: each trains through spawn_ddp.py with 2 processes and
--workers 2, is stopped by SIGTERM to every process in the middle of an epoch and resumes
bit-identically, and --evaluate reports the regression's own metric. A task that does not fit
fails in one line, with its own frames under it, before the first step (the check leaves no
trace: test_data_loading.py)."""
import os
import re

import pytest

from conftest import ROOT, TASK_RUN, TASKS, TORCHRUN2, assert_same_training_state, command, \
    given, kept, load, read_metrics, read_records, run_mains, run_script, script_env, sigterm_when

pytestmark = pytest.mark.slow

METRICS = {  # the metric and what it must reach, the launcher that stops and resumes it, and
    # the LR line of its own recipe (cifar10's: SGD, the linear rule; FakeData's labels are noise)
    "text": ("test_acc", lambda v: v > 40, "spawn_ddp.py",
             "LR 0.003 at batch 256 -> 0.0015 at 64 (square-root rule, for Adam)"),
    "regression": ("test_rmse", lambda v: v < 1.2, "torchrun_ddp.py",
                   "LR 0.003 at batch 256 -> 0.002121 at 128 (square-root rule, for Adam)"),
    "cifar10": ("test_acc", lambda v: 0 <= v <= 100, "torchrun_ddp.py",
                "LR 0.1 at batch 256 -> 0.025 at 64 (linear rule, for SGD)"),
}
MACHINERY = "checkpoint|data|flags|launch|machine|reporting|_ddp"  # files, less common.py


def flags(d, name):
    """A task's run flags, as conftest.task_run gives it (outside the checkout)."""
    return ("--task", given(d, name)[0], *TASKS[name], *TASK_RUN)


@pytest.mark.parametrize("name", TASKS)
def test_trains_and_reports_its_own_metric(task_run, tmp_path, name):
    """conftest.task_run's run of the task: its metric in every epoch, its own LR recipe,
    nothing of MNIST prepared. --evaluate of the regression's checkpoint reports its own
    metric, the RMSE, and no LR line."""
    d = task_run(name)
    metric, good, _, said = METRICS[name]
    out = kept(d, "run").stdout
    assert f"task {given(d, name)[0]}" in out.splitlines() and said in out, out
    rows = read_metrics(d / "m.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and good(rows[-1][metric]), rows
    assert not (d / "data").exists()  # MNIST's preparation did nothing for another task
    if name == "regression":
        r = run_script("spawn_ddp.py", *flags(d, name), "--checkpoint", d / "c.pt",
                       "--evaluate", cwd=tmp_path, timeout=300)
        [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch 2 evaluate True")]
        assert f"{metric} {rows[-1][metric]:.4g}" in line, (line, rows[-1])
        assert "LR " not in r.stdout  # an evaluation trains nothing: no LR rule to say


@pytest.mark.parametrize("name", TASKS)
def test_stopped_by_sigterm_and_resumed_bit_identical(task_run, tmp_path, name):
    """SIGTERM to every process in the middle of epoch 1, data workers too (text under
    spawn_ddp.py, the others under torchrun_ddp.py: each launcher's stop is the same code for
    any task, test_preemption.py), then the resume: it ends where conftest.task_run's run
    (spawn_ddp.py's) ends."""
    d = task_run(name)
    script = METRICS[name][2]
    ckpt = tmp_path / "c.pt"
    cmd = command(script, 2, *flags(d, name), "--checkpoint", ckpt)
    # steps slowed (same results) so that the signal lands in the middle of epoch 1
    err = sigterm_when(cmd, "epoch 1/2 step 3/", script_env(
        DDP_TEST_STEP_DELAY=0.2, OMP_NUM_THREADS=1, pythonpath=given(d, name)[1]),
        cwd=tmp_path).stderr  # to every process, data workers too
    assert "DataLoader worker" not in err, err  # (torchrun's agent prints a traceback of its own)
    assert not re.search(rf'File "[^"]*(common|{MACHINERY})\.py"', err), err
    assert sum("preempted:" in ln for ln in err.splitlines()) == 1, err
    snap = load(ckpt)
    assert snap["epoch"] == 0 and 3 <= snap["step"] < 8, snap["step"]  # mid-epoch 1
    r = run_script(script, *flags(d, name), "--checkpoint", ckpt, "--metrics", tmp_path / "m.jsonl",
                   *(["--resume"] if script == "spawn_ddp.py" else []), nproc=2, cwd=tmp_path,
                   timeout=300, pythonpath=given(d, name)[1], OMP_NUM_THREADS=1)
    assert f"0 epoch(s) + {snap['step']} step(s) trained" in r.stdout
    assert_same_training_state(load(d / "c.pt"), load(ckpt))
    first, second = read_metrics(tmp_path / "m.jsonl")  # the resumed epoch says it is partial
    assert first["partial"] == f"steps {snap['step'] + 1}-8 of 8 (resumed)", first
    assert "partial" not in second


def test_a_task_by_module_name_and_its_flags_in_help(task_run, tiny_mnist):
    """--task mypkg.text imports a module from the path and trains (conftest.task_run gives the
    text task so); its flags show in --help; a resume with another task (or none: MNIST's) is
    refused by the checkpoint's run, --evaluate names the checkpoint's task, and no code the
    checkpoint names is imported (mypkg is not on the path then). The refusals and the help
    through the scripts' real main() (tests/run_mains.py)."""
    d = task_run("text")
    assert "task mypkg.text" in kept(d, "run").stdout.splitlines()
    [r] = run_mains("spawn_ddp.py", [{"argv": ["--task", "mypkg.text", "--help"]}],
                    pythonpath=given(d, "text")[1])
    assert r["code"] == 0 and "--samples" in r["stdout"] and "--task" in r["stdout"], r
    ckpt = str(d / "c.pt")
    [r] = run_mains("spawn_ddp.py", [{"argv": ["--data-dir", str(tiny_mnist), "--batch-size", "64",
                                               "--epochs", "2", "--checkpoint", ckpt,
                                               "--resume"]}])
    assert r["code"] == 2 and "--task mypkg.text in the checkpoint, (not given) now" in r["stderr"]
    for script in ("spawn_ddp.py", "torchrun_ddp.py"):  # (spawn's launcher, torchrun's process)
        [r] = run_mains(script, [{"argv": ["--dummy", "--checkpoint", ckpt, "--evaluate"]}])
        assert r["code"] == 2 and r["stderr"].strip().splitlines()[-1] == (
            f"error: {ckpt} was trained with --task mypkg.text, this run has no --task "
            "(MNIST): evaluate it with --task mypkg.text"), r


def test_a_task_file_is_one_task_however_it_is_spelled(task_run, tmp_path):
    """The regression task, trained as an absolute path (conftest.task_run), resumes and
    evaluates as a relative one from another folder, and as a path through a link; another
    file of the same name is another task, refused. Through the scripts' real main()."""
    d = task_run("regression")
    task, ckpt = given(d, "regression")[0], str(d / "c.pt")
    link = tmp_path / "linked"
    link.symlink_to(task.parent)
    other = tmp_path / "other" / "regression.py"
    other.parent.mkdir()
    other.write_text(task.read_text())
    spellings = [os.path.relpath(task, ROOT), str(link / "regression.py"), str(other)]
    evaluate = [["--task", t, *TASKS["regression"], "--checkpoint", ckpt, "--evaluate"]
                for t in spellings]
    resume = [[*flags(d, "regression")[2:], "--task", t, "--checkpoint", ckpt, "--resume"]
              for t in spellings]
    results = run_mains("spawn_ddp.py", [{"argv": [str(a) for a in argv]}
                                         for argv in evaluate + resume])
    assert [r["started"] for r in results] == [True, True, False] * 2, results
    assert f"was trained with --task {task}, this run has --task {other}" in results[2]["stderr"]
    assert f"--task {task} in the checkpoint, {other} now" in results[5]["stderr"]


SPARE_HEAD = """
class TwoHeads(nn.Module):  # a second head its forward never uses
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU())
        self.head, self.spare = nn.Linear(64, 1), nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(x)).sum(1)  # a new tensor: FSDP2 warns of a view


def make_model(args):
    return TwoHeads()
"""


def test_a_parameter_without_a_gradient_is_named_or_trained_past(tmp_path):
    """A model with a head its forward skips: DDP without --find-unused-parameters (one
    process) is refused in one line that names the head's parameters and the flag, before the
    first update, exit 2; with the flag (torchrun, 2 processes) it trains; FSDP2, which needs no
    flag (a parameter without a gradient takes no part in the reduce-scatter or the step),
    trains the same model and optimizer state, in fp32."""
    task = tmp_path / "spare.py"
    task.write_text((ROOT / "tasks" / "regression.py").read_text() + SPARE_HEAD)
    flags = ("--task", task, "--samples", 256, "--batch-size", 64, "--epochs", 2, "--amp",
             "none", "--log-interval", 1)
    r = run_script("torchrun_ddp.py", *flags, cwd=tmp_path, check=False)  # one process: DDP too
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(errors) == 1 and "step 1/" not in r.stdout, r.stderr
    assert errors[0] == ("error: the model's spare.weight, spare.bias got no gradient in the first "
                         "step (a branch its forward skips): add --find-unused-parameters, or "
                         "freeze them (requires_grad=False)"), errors
    run_script("torchrun_ddp.py", *flags, "--find-unused-parameters", "--checkpoint",
               tmp_path / "ddp.pt", launcher=TORCHRUN2, cwd=tmp_path, OMP_NUM_THREADS=1)
    run_script("torchrun_fsdp.py", *flags, "--checkpoint", tmp_path / "snap", launcher=TORCHRUN2,
               cwd=tmp_path, OMP_NUM_THREADS=1)
    assert_same_training_state(load(tmp_path / "ddp.pt"), load(tmp_path / "snap"))


BATCHNORM = """
def make_model(args):  # BatchNorm1d: a batch of one sample cannot be normalised in training
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.BatchNorm1d(64), nn.ReLU(),
                         nn.Linear(64, 1), nn.Flatten(0))
"""


def test_a_shard_that_ends_in_one_sample_trains_with_batchnorm(tmp_path):
    """130 rows at 2 processes: shards of 65, batches of 32 each, so each shard ends in a
    batch of one, which BatchNorm1d cannot normalise in training. Every process leaves it out:
    2 steps an epoch, 2 epochs, exit 0 (torchrun)."""
    task = tmp_path / "norm.py"
    task.write_text((ROOT / "tasks" / "regression.py").read_text() + BATCHNORM)
    r = run_script("torchrun_ddp.py", "--task", task, "--samples", 130, "--batch-size", 64,
                   "--epochs", 2, "--log-interval", 1, "--metrics", tmp_path / "m.jsonl",
                   launcher=TORCHRUN2, cwd=tmp_path, OMP_NUM_THREADS=1)
    assert re.findall(r"^epoch (\d)/2 step (\d)/(\d)", r.stdout, re.M) == [
        ("1", "1", "2"), ("1", "2", "2"), ("2", "1", "2"), ("2", "2", "2")], r.stdout
    assert [row["epoch"] for row in read_metrics(tmp_path / "m.jsonl")] == [1, 2]


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


FIRST_STEP = " in the first training step"


@pytest.mark.parametrize("name,extra,said,frame,script", [
    ("regression", BAD_SHAPE, f"{FIRST_STEP}: output [32] and target [32, 1] only broadcast to "
     "each other; loss_fn(output, target) raised UserWarning", "loss_fn",
     "spawn_ddp.py"),
    ("text", SHORT_POSITIONS, ": the model's forward raised IndexError: index out of range in "
     "self", "forward", "torchrun_ddp.py"),  # in the evaluation-mode check already
    ("regression", TRAIN_MODE_ONLY, f"{FIRST_STEP} (train mode; the evaluation-mode check "
     "passed): the model's forward raised RuntimeError: only in train mode", "forward",
     "torchrun_ddp.py"),
], ids=["target-that-only-broadcasts", "positions-shorter-than-training-sequences",
        "a-model-that-fails-in-train-mode-only"])
def test_a_task_that_does_not_fit_fails_in_one_line_before_training(tmp_path, name, extra, said,
                                                                     frame, script):
    """The run is the check: each process evaluates a test batch before training (eval mode),
    and its first training step runs the model in train mode and calls loss_fn with warnings
    as errors: one `error:` line per process, before any optimizer step and before anything is
    written, naming where (the first training step; in train mode, after the evaluation-mode
    check) and the part that failed, our diagnosis before torch's words, in about 200
    characters, with the task's frames under it (its file and line) and no "Traceback" header.
    spawn_ddp.py's 2 processes; `python torchrun_ddp.py`'s one."""
    bad = tmp_path / f"bad_{name}.py"
    bad.write_text((ROOT / "tasks" / f"{name}.py").read_text() + extra)
    rec = tmp_path / "rec"
    rec.mkdir()
    r = run_script(script, "--task", bad, "--samples", 256, "--batch-size", 64,
                   "--log-interval", 1, "--checkpoint", tmp_path / "c.pt", cwd=tmp_path,
                   record=rec, check=False, timeout=300)
    assert not read_records(rec, "lr") and not (tmp_path / "c.pt").exists()
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode != 0 and errors, r.stderr
    assert f"error: the task does not fit the scripts{said}" in errors[0], errors[0]
    assert errors[0].endswith(" (docs/your-own-task.md)") and len(errors[0]) <= 220, errors[0]
    assert f'File "{bad}", line' in r.stderr and f"in {frame}" in r.stderr, r.stderr
    assert not re.search(rf'File "[^"]*({MACHINERY})\.py"', r.stderr), r.stderr
    assert "Traceback" not in r.stderr and "step" not in r.stdout, r.stderr
