"""Bad input, refused before anything starts: every flag of every script, as one table.

Each row is a command line with one bad value (or a combination that cannot work). The
expectation is the same for all of them: exit code 2, exactly one line on stderr that starts with
`error:` and names the flag or file, no traceback, and no training started. To keep a table of
~200 rows in seconds, tests/run_mains.py runs each script's real main() for all of its rows in
one process and stops a run at the point where work would begin (reading the training data,
spawning workers, starting a subprocess). Real launches of the same checks, one per failure
class, follow the table."""
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
from conftest import N_TEST, N_TRAIN, ROOT, make_tiny_mnist, process_group, run_mains, \
    run_script, script_env, wait_for, write_idx

SCRIPTS = ("dp_baseline.py", "spawn_ddp.py", "torchrun_ddp.py", "apex_ddp.py", "torchrun_fsdp.py")
DDP = SCRIPTS[1:]
FILE_FORM = SCRIPTS[:4]  # a checkpoint file (torchrun_fsdp.py's is a folder: test_fsdp.py)
TORCHRUN_RANK_0_OF_2 = {"RANK": "0", "WORLD_SIZE": "2"}  # what torchrun tells the first of 2


def rows(tmp, data):
    """(scripts, argv, env, text the error line must contain). argv is appended to --dummy
    unless it names its own --data-dir."""
    folder, existing = str(tmp / "a-folder"), str(tmp / "existing.pt")
    os.makedirs(folder, exist_ok=True)
    Path(existing).write_bytes(b"another run's checkpoint")
    garbage, cut, other = (str(tmp / name) for name in ("garbage.pt", "cut.pt", "other.pt"))
    Path(garbage).write_bytes(random.Random(0).randbytes(4096))
    whole = tmp / "whole.pt"  # a checkpoint of this model, then its first half alone
    torch.save({"model": common.Net().state_dict(), "epoch": 1}, whole)
    Path(cut).write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    torch.save({"model": torch.nn.Linear(784, 10).state_dict(), "epoch": 1}, other)
    table = [
        (SCRIPTS, ["--task", str(tmp / "no-such-task.py")], {}, "--task"),
        (SCRIPTS, ["--task", "no_such_module.task"], {}, "--task"),
        (SCRIPTS, ["--epochs", "0"], {}, "--epochs"),
        (SCRIPTS, ["--epochs", "-1"], {}, "--epochs"),
        (SCRIPTS, ["--epochs", "two"], {}, "--epochs"),
        (SCRIPTS, ["--stop-after", "0"], {}, "--stop-after"),
        (SCRIPTS, ["--epochs", "2", "--stop-after", "3"], {}, "--stop-after"),
        (SCRIPTS, ["--batch-size", "0"], {}, "--batch-size"),
        (SCRIPTS, ["--batch-size", "-4"], {}, "--batch-size"),
        (SCRIPTS, ["--batch-size", "2.5"], {}, "--batch-size"),
        (SCRIPTS, ["--lr", "-1"], {}, "--lr"),
        (SCRIPTS, ["--lr", "0"], {}, "--lr"),
        (SCRIPTS, ["--lr", "nan"], {}, "--lr"),
        (SCRIPTS, ["--lr", "inf"], {}, "--lr"),
        (SCRIPTS, ["--lr-scaling", "cubic"], {}, "--lr-scaling"),
        (SCRIPTS, ["--warmup-epochs", "-1"], {}, "--warmup-epochs"),
        (SCRIPTS, ["--warmup-epochs", "1"], {}, "--warmup-epochs"),  # as long as --epochs 1
        (SCRIPTS, ["--seed", "-1"], {}, "--seed"),
        (SCRIPTS, ["--seed", "1.5"], {}, "--seed"),
        (SCRIPTS, ["--amp", "fp8"], {}, "--amp"),
        (SCRIPTS, ["--save-every", "-1"], {}, "--save-every"),
        (SCRIPTS, ["--save-every", "5"], {}, "--save-every"),  # no --checkpoint to save to
        (SCRIPTS, ["--resume"], {}, "--resume"),
        (SCRIPTS, ["--evaluate"], {}, "--evaluate"),
        (SCRIPTS, ["--checkpoint", str(tmp / "none.pt"), "--resume"], {}, "no checkpoint"),
        (FILE_FORM, ["--checkpoint", garbage, "--resume"], {}, f"{garbage} is corrupt"),
        (FILE_FORM, ["--checkpoint", cut, "--evaluate"], {}, f"{cut} is corrupt or truncated"),
        (FILE_FORM, ["--checkpoint", other, "--evaluate"], {}, f"{other} does not fit this model"),
        (SCRIPTS, ["--checkpoint", "/proc/x/c.pt"], {}, "--checkpoint"),  # cannot create
        (SCRIPTS, ["--checkpoint", "/proc/c.pt"], {}, "--checkpoint"),    # cannot write there
        (SCRIPTS, ["--checkpoint", folder], {}, "--checkpoint"),          # a folder
        (SCRIPTS, ["--metrics", "/proc/x/m.jsonl"], {}, "--metrics"),
        (SCRIPTS, ["--metrics", folder], {}, "--metrics"),
        (SCRIPTS, ["--tensorboard", str(tmp / "tb")], {"DDP_TEST_BLOCK": "tensorboard"},
         "--tensorboard needs the tensorboard package: pip install tensorboard"),
        (SCRIPTS, ["--tensorboard", existing], {}, "--tensorboard"),  # a file
        (SCRIPTS, ["--tensorboard", "/proc/x/tb"], {}, "--tensorboard"),  # cannot create
        (SCRIPTS, ["--log-interval", "0"], {}, "--log-interval"),
        (SCRIPTS, ["--no-such-flag"], {}, "--no-such-flag"),
        (SCRIPTS, ["--data-dir", "/dev/null"], {}, "/dev/null"),
        (DDP, ["--timeout", "0"], {}, "--timeout"),
        (DDP, ["--timeout", "-5"], {}, "--timeout"),
        (DDP, ["--join-timeout", "0"], {}, "--join-timeout"),
        (DDP, ["--join-timeout", "soon"], {}, "--join-timeout"),
        (SCRIPTS, ["--workers", "-1"], {}, "--workers"),
        (SCRIPTS, ["--workers", "two"], {}, "--workers"),
        (("spawn_ddp.py",), ["--batch-size", "255"], {}, "--batch-size 255"),  # 2 processes
        (("torchrun_ddp.py", "apex_ddp.py"), ["--batch-size", "255"], TORCHRUN_RANK_0_OF_2,
         "--batch-size 255"),
        (SCRIPTS, ["--accumulate", "0"], {}, "--accumulate"),
        (SCRIPTS, ["--accumulate", "1.5"], {}, "--accumulate"),
        (("dp_baseline.py",), ["--batch-size", "30", "--accumulate", "4"], {},
         "world size x --accumulate = 1 x 4"),
        (("spawn_ddp.py",), ["--batch-size", "36", "--accumulate", "4"], {},  # 2 processes
         "world size x --accumulate = 2 x 4"),
        (("torchrun_ddp.py", "apex_ddp.py"), ["--batch-size", "36", "--accumulate", "4"],
         TORCHRUN_RANK_0_OF_2, "world size x --accumulate = 2 x 4"),
        (("spawn_ddp.py",), ["--nproc-per-node", "0"], {}, "--nproc-per-node"),
        (("spawn_ddp.py",), ["--nnodes", "0"], {}, "--nnodes"),
        (("spawn_ddp.py",), ["--node-rank", "-1"], {}, "--node-rank"),
        (("spawn_ddp.py",), ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1",
                             "--master-port", "29999"], {}, "--node-rank"),
        (("spawn_ddp.py",), ["--nnodes", "2", "--node-rank", "1"], {}, "--master-addr"),
        (("spawn_ddp.py",), ["--nnodes", "2", "--master-port", "29999"], {}, "--master-addr"),
        (("spawn_ddp.py",), ["--master-port", "0"], {}, "--master-port"),
        (("spawn_ddp.py",), ["--master-port", "70000"], {}, "--master-port"),
        (("torchrun_ddp.py", "apex_ddp.py"), ["--local-rank", "-1"], {}, "--local-rank"),
        (("apex_ddp.py",), ["--opt-level", "O4"], {}, "--opt-level"),
        (("apex_ddp.py",), ["--amp", "bf16"], {}, "--opt-level"),
        (("dp_baseline.py",), ["--gpus", "x"], {}, "--gpus"),
        (("dp_baseline.py",), ["--gpus", "7"], {}, "--gpus"),
        (("dp_baseline.py",), ["--gpus", "0,x"], {}, "--gpus"),
        (("dp_baseline.py",), ["--gpus", "0,0"], {}, "GPU ids must differ"),
        (("dp_baseline.py",), ["--gpus", "1"], {}, "but this machine has 0 GPU(s)"),
        # a fresh run never overwrites a checkpoint (torchrun's resume theirs, refuse others')
        (("dp_baseline.py", "spawn_ddp.py"), ["--checkpoint", existing], {},
         f"--checkpoint {existing} exists: add --resume to continue its run, or give another"),
        (("dp_baseline.py",), ["--compile"], {}, "--compile"),  # DataParallel: not documented
        (("dp_baseline.py",), ["--timeout", "5"], {}, "--timeout"),  # one process: no peers
        (("dp_baseline.py",), ["--join-timeout", "5"], {}, "--join-timeout"),
        (("dp_baseline.py",), ["--save-on-each-node"], {}, "--save-on-each-node"),
        (("bench.py",), ["--reps", "0"], {}, "--reps"),
        (("bench.py",), ["--epochs", "0"], {}, "--epochs"),
        (("bench.py",), ["--batch-size", "0"], {}, "--batch-size"),
        (("bench.py",), ["--world-sizes", "0"], {}, "--world-sizes"),
        (("bench.py",), ["--timeout", "0"], {}, "--timeout"),
        (("bench.py",), ["--amp", "fp8"], {}, "--amp"),
        (("bench.py",), ["--scripts", "nope"], {}, "--scripts"),
        (("bench.py",), ["--channels-last", "maybe"], {}, "--channels-last"),
        (("bench.py",), ["--scripts", "dp_baseline", "--world-sizes", "2"], {}, "no script"),
    ]
    if not torch.cuda.is_available():
        table += [((s,), ["--sync-bn"], {}, "--sync-bn needs " + ("the DDP scripts" if s ==
                   "dp_baseline.py" else "CUDA")) for s in SCRIPTS]
    # Malformed MNIST files: each names the files of its split, and what is wrong if it can.
    for name, (broken, fragment) in malformed(tmp, data).items():
        table.append((SCRIPTS, ["--data-dir", str(broken)], {}, fragment))
    return [(s, argv, env, text) for scripts, argv, env, text in table for s in scripts]


def malformed(tmp, data):
    """Copies of the tiny MNIST with one file broken: {case: (data dir, expected fragment)}. What
    torchvision cannot read is named by its split; what it reads but is not MNIST, by the fault."""
    labels, images = "train-labels-idx1-ubyte", "train-images-idx3-ubyte"
    split = "{raw}/train-*-ubyte: not MNIST files"
    faults = {  # case: (the file, its new content (a tensor, or of its old bytes), the text)
        "count mismatch": (labels, torch.zeros(N_TRAIN - 1),
                           f"{N_TRAIN} images but {N_TRAIN - 1} labels"),
        "wrong magic": (images, lambda b: b"\x00\x00\x08\x01" + b[4:], split),
        "wrong dimensions": (images, torch.zeros(N_TRAIN, 32, 32), "32x32 images"),
        "garbage": ("t10k-images-idx3-ubyte", lambda b: os.urandom(5000),
                    "{raw}/t10k-*-ubyte: not MNIST files"),
        "empty": (labels, lambda b: b"", split),
        "truncated": (images, lambda b: b[:-100], split),
        "trailing bytes": (images, lambda b: b + b"\0" * 10, split),
        "label out of range": (labels, torch.full((N_TRAIN,), 12), "labels up to 12"),
    }
    cases = {}
    for case, (name, new, said) in faults.items():
        d = tmp / f"data-{case.replace(' ', '-')}"
        r = d / "MNIST" / "raw"
        if not d.exists():
            shutil.copytree(data, d)
            write_idx(r / name, new) if torch.is_tensor(new) else \
                (r / name).write_bytes(new((r / name).read_bytes()))
        cases[case] = (d, said.format(raw=r))
    return cases


@pytest.fixture(scope="module")
def table(tiny_mnist, tmp_path_factory):
    """Runs every row through tests/run_mains.py, one process per script, and then the task
    files that do not import (test_a_task_that_does_not_import_is_bad_input): ({row: (result,
    the text its error line must contain)}, {script: (files, results)})."""
    tmp = tmp_path_factory.mktemp("bad")
    cases, files = rows(tmp, tiny_mnist), {}
    for case, (text, *_) in TASKS_THAT_DO_NOT_IMPORT.items():
        files[case] = tmp / f"task_{case}.py"
        files[case].write_text(text)
    results, tasks = [None] * len(cases), {}
    for script in sorted({c[0] for c in cases}):
        mine = [i for i, c in enumerate(cases) if c[0] == script]
        ran = run_mains(script, [{"argv": argv if "--data-dir" in argv else ["--dummy", *argv],
                                  "env": env} for _, argv, env, _ in (cases[i] for i in mine)]
                        + [{"argv": ["--task", str(f)]} for f in files.values()])
        for i, result in zip(mine, ran[:len(mine)], strict=True):
            results[i] = (result, cases[i][3])
        tasks[script] = (files, ran[len(mine):])
    return results, tasks


def pytest_generate_tests(metafunc):
    """One test per row, named after it (the table's temporary paths shown as TMP)."""
    if "row" in metafunc.fixturenames:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            data = make_tiny_mnist(Path(d) / "mnist", n_train=N_TRAIN, n_test=N_TEST)
            ids = [f"{s} {' '.join(a)}".replace(d, "TMP") for s, a, _, _ in rows(Path(d), data)]
        metafunc.parametrize("row", range(len(ids)), ids=ids)


def test_bad_input_is_one_line_before_anything_starts(table, row):
    result, text = table[0][row]
    where = f"{' '.join(result['argv'])}\nstdout:\n{result['stdout']}\nstderr:\n{result['stderr']}"
    assert not result["started"], f"work started despite the bad input: {where}"
    assert result["code"] == 2, where
    lines = [ln for ln in result["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and re.match(r"(\[rank 0\] )?error: ", lines[0]), where
    assert text in lines[0], where


TASKS_THAT_DO_NOT_IMPORT = {  # a task file's text, the error, its line, what shows under it
    "syntax": ("import torch\n\ndef make_model(args:\n    return None\n",
               "SyntaxError: '(' was never closed", 3, "^"),
    "import": ("import torch\nimport no_such_dependency\n",
               "ModuleNotFoundError: No module named 'no_such_dependency'", 2,
               "import no_such_dependency"),
    "runtime": ("SIZES = [1, 2]\nSIZE = SIZES[5]\n", "IndexError: list index out of range", 2,
                "~~~~~^^^"),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_task_that_does_not_import_is_bad_input(table, script):
    """A task file with a syntax error, or whose import fails, is bad input: the error, the
    task's file and line, its source line and the caret under it; exit code 2, nothing started,
    and none of the scripts' frames (nor importlib's)."""
    files, results = table[1][script]
    for (case, (_, error, line, shown)), r in zip(TASKS_THAT_DO_NOT_IMPORT.items(), results):
        lines = r["stderr"].rstrip().splitlines()
        assert r["code"] == 2 and not r["started"], (case, r)
        assert lines[0] == f"error: --task {files[case]}: {error}", (case, lines)
        assert lines[1].startswith(f'  File "{files[case]}", line {line}'), (case, lines)
        assert shown in lines[-1] and len(lines) <= 4, (case, lines)
        assert r["stderr"].count('File "') == 1, (case, r["stderr"])


def test_missing_output_folders_are_created_and_said(tiny_mnist, tmp_path):
    """The good side of the output checks: missing folders are made before training, once."""
    new = tmp_path / "new"
    args = ["--dummy", "--checkpoint", str(new / "ck" / "c.pt"), "--metrics",
            str(new / "m" / "m.jsonl")]
    [result] = run_mains("spawn_ddp.py", [{"argv": args, "env": {}}])
    assert result["started"] and not result["stderr"].strip()
    for folder in ("ck", "m"):
        assert (new / folder).is_dir()
        assert f"created folder {new / folder}" in result["stdout"]


# ---- the same checks through real launches ---------------------------------------------------

def no_traceback_from_us(text):
    """No traceback frame in the scripts or common.py (torchrun prints its own ChildFailedError
    traceback after a worker fails: that one is not ours to shorten)."""
    return not re.search(r'File "[^"]*(common|_ddp|dp_baseline)\.py", line', text)


def assert_error_line(r, *fragments):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "error:" in ln]
    assert r.returncode != 0 and lines, r.stderr
    for f in fragments:
        assert f in lines[0], (f, r.stderr)
    assert no_traceback_from_us(r.stderr), r.stderr
    assert "step" not in r.stdout  # no training step was logged


@pytest.mark.parametrize("script", ["spawn_ddp.py", pytest.param("torchrun_ddp.py",
                                                                   marks=pytest.mark.slow)])
def test_unwritable_checkpoint_fails_before_training(tiny_mnist, script):
    r = run_script(script, "--data-dir", tiny_mnist, "--checkpoint", "/proc/x/c.pt",
                   "--log-interval", 1, nproc=2, check=False, timeout=120)
    assert_error_line(r, "--checkpoint /proc/x/c.pt", "cannot create the folder")


@pytest.mark.slow
@pytest.mark.parametrize("flags, said", [
    (("--amp", "off"), "error: argument --amp: invalid choice: 'off'"),
    (("--checkpoint", "/proc/x/c.pt"), "error: --checkpoint /proc/x/c.pt: cannot create")],
    ids=["flag", "checkpoint"])
def test_a_refusal_reaches_the_user_when_the_first_process_is_late(tiny_mnist, flags, said):
    """Under torchrun every process refuses bad input alike and the node's first says it. Here
    that one starts 30 s after the other (DDP_TEST_LATE_START: a slow import), so rank 1 refuses
    first, and torchrun's agent ends rank 0 as soon as rank 1 exits: rank 1's line must reach
    the user, once. (It was lost: rank 1 said nothing, and rank 0 never got to.)"""
    r = run_script("torchrun_ddp.py", "--data-dir", tiny_mnist, *flags, nproc=2, check=False,
                   timeout=120, DDP_TEST_LATE_START=30)
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"[rank 1] {said}"), r.stderr
    assert no_traceback_from_us(r.stderr), r.stderr


def test_detail_debug_level_is_refused_on_gloo(tiny_mnist, tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL makes DDP's constructor read the wrong object on gloo
    (test_ddp_reads_the_wrong_object_under_detail_on_gloo): a clear line instead of a worker
    dying with SIGSEGV, or not, depending on memory. torch reads the variable when it is
    imported, so this is a real launch, not a row of the table."""
    r = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--log-interval", 1, check=False,
                   timeout=120, cwd=tmp_path, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    assert r.returncode == 2, r.stderr
    assert_error_line(r, "TORCH_DISTRIBUTED_DEBUG=DETAIL", "use INFO")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_malformed_data_fails_with_the_file_named(tiny_mnist, tmp_path, script):
    """Under torchrun, local rank 0 checks the files while the others wait at a barrier: the
    error must end the job, not leave it hanging."""
    broken, fragment = malformed(tmp_path, tiny_mnist)["count mismatch"]
    r = run_script(script, "--data-dir", broken, "--log-interval", 1, "--timeout", 30, nproc=2,
                   check=False, timeout=120)
    assert_error_line(r, fragment)


# ---- a full disk, or a disk that turns read-only, never costs the last good snapshot --------

SAVE_ARGS = ("--batch-size", 32, "--epochs", 2, "--save-every", 6, "--log-interval", 100)
# 19 steps per epoch: snapshots at steps 6, 12, 18


def check_previous_snapshot_kept(r, ckpt, reason):
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "could not write the checkpoint" in ln]
    assert lines and reason in lines[0] and "the previous one, if any, is intact" in lines[0], r.stderr
    assert no_traceback_from_us(r.stderr), r.stderr
    state = torch.load(ckpt, weights_only=True)  # still whole and loadable
    assert (state["epoch"], state["step"]) == (0, 6)
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["c.pt"]  # the .tmp file is gone


@pytest.mark.slow
@pytest.mark.parametrize("script,extra", [("spawn_ddp.py", ["--nproc-per-node", 2, "--timeout", 30]),
                                          ("dp_baseline.py", [])])
def test_full_disk_keeps_the_previous_snapshot(tiny_mnist, small_disk, script, extra):
    ckpt = small_disk / "c.pt"
    r = run_script(script, "--data-dir", tiny_mnist, *SAVE_ARGS, *extra, "--checkpoint", ckpt,
                   check=False, timeout=120)
    check_previous_snapshot_kept(r, ckpt, "No space left on device")


@pytest.mark.slow
def test_disk_turning_read_only_keeps_the_previous_snapshot(tiny_mnist, small_disk):
    """Write permission lost mid-run (here: the filesystem remounted read-only after the first
    snapshot); every process stops, none hangs."""
    ckpt = small_disk / "c.pt"
    cmd = [sys.executable, str(ROOT / "spawn_ddp.py"), "--data-dir", str(tiny_mnist),
           *map(str, SAVE_ARGS), "--nproc-per-node", "2", "--timeout", "30", "--checkpoint", str(ckpt)]
    with process_group(cmd, script_env(DDP_TEST_STEP_DELAY=0.2)) as proc:
        wait_for(ckpt.exists, 90, "the first snapshot")
        r = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        out, err = proc.communicate(timeout=120)
    check_previous_snapshot_kept(subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                                 ckpt, "Read-only file system")
