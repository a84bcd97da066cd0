"""apex_ddp.py against NVIDIA apex itself: release 25.05 (the last with apex.amp and
apex.parallel), its Python-only build, installed from APEX_SRC (the source tarball or folder)
into a temporary folder once per session. Skipped, with the reason, without APEX_SRC; .ci/run
sets it to ../shared/vendor/apex-25.05.tar.gz when that file exists.

Real apex is imported only in subprocesses, never into the pytest process: it has the same
top-level name as the stand-in in tests/standin (whichever is imported first owns
sys.modules["apex"]), importing it adds a logging handler, and amp.initialize patches torch
functions for the whole process."""
import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import N_TEST, ROOT, assert_same_training_state, load, load_on_cpu, \
    optimizer_steps, read_metrics, read_records, run_script, script_env

sys.path.insert(0, str(ROOT))
import common  # noqa: E402

pytestmark = pytest.mark.slow  # installing apex takes 15-30 s

SCRIPT = "apex_ddp.py"
STANDIN = ROOT / "tests" / "standin"


@pytest.fixture(scope="session")
def real_apex(tmp_path_factory):
    """The folder that real apex was installed into (put it on PYTHONPATH to use it)."""
    src = os.environ.get("APEX_SRC")
    if not src:
        pytest.skip("APEX_SRC is not set: point it at NVIDIA apex 25.05's source, a tarball or "
                    "folder (.ci/run sets it to ../shared/vendor/apex-25.05.tar.gz when that "
                    "exists)")
    src = Path(src).resolve()
    if not src.exists():
        pytest.fail(f"APEX_SRC={src}: no such file or folder")
    target = tmp_path_factory.mktemp("real-apex")
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
           "--disable-pip-version-check", "--target", str(target), str(src)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building apex from {src} took over 600 s")
    if r.returncode != 0:
        pytest.fail(f"pip could not install apex from {src}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    found = describe_apex(target, [])  # and the scripts will import this copy, not another
    assert found["file"] == str(target / "apex" / "__init__.py") and not found["stand_in"], found
    return target


# Runs in a subprocess with one apex or the other first on PYTHONPATH. For each dotted name:
# the parameters of the function (of __init__ for a class), as (name, kind, default).
DESCRIBE = """
import importlib, importlib.util, inspect, json, sys
import apex
def params(obj):
    f = obj.__init__ if inspect.isclass(obj) else obj
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(f).parameters.values()]
out = {"file": apex.__file__, "stand_in": getattr(apex, "STAND_IN", False), "signatures": {}}
for dotted in sys.argv[1:]:  # a function, a class, or a method: apex.parallel.Class.method
    parts = dotted.split(".")
    at = max(i for i in range(1, len(parts)) if importlib.util.find_spec(".".join(parts[:i])))
    obj = importlib.import_module(".".join(parts[:at]))
    for name in parts[at:]:
        obj = getattr(obj, name)
    out["signatures"][dotted] = params(obj)
print(json.dumps(out))
"""


def describe_apex(path, names):
    r = subprocess.run([sys.executable, "-c", DESCRIBE, *names], env=script_env(pythonpath=[path]),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def apex_names_the_script_uses():
    """Every apex function apex_ddp.py calls, read from its source: `amp.X(...)` calls, the
    names it imports from apex.parallel, and the DDP methods `X_allreduce()` it calls."""
    tree = ast.parse((ROOT / SCRIPT).read_text())
    amp = {f"apex.amp.{n.func.attr}" for n in ast.walk(tree)
           if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
           and isinstance(n.func.value, ast.Name) and n.func.value.id == "amp"}
    parallel = {f"apex.parallel.{a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module == "apex.parallel" for a in n.names}
    ddp_methods = {f"apex.parallel.DistributedDataParallel.{n.func.attr}" for n in ast.walk(tree)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and n.func.attr.endswith("_allreduce")}  # model.disable_allreduce() ...
    return amp | parallel | ddp_methods


def path_line(result):
    [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("path: ")]
    return line


def test_standin_has_real_apex_signatures(real_apex):
    """The stand-in (tests/standin) must accept exactly what apex accepts, for every apex
    function apex_ddp.py calls, or test_apex_ddp.py could pass with calls that real apex
    rejects."""
    names = sorted(apex_names_the_script_uses())
    assert names == ["apex.amp.initialize", "apex.amp.load_state_dict", "apex.amp.scale_loss",
                     "apex.amp.state_dict", "apex.parallel.DistributedDataParallel",
                     "apex.parallel.DistributedDataParallel.disable_allreduce",
                     "apex.parallel.DistributedDataParallel.enable_allreduce",
                     "apex.parallel.convert_syncbn_model"], \
        "apex_ddp.py calls other apex functions now: give the stand-in each, and list it here"
    real, standin = describe_apex(real_apex, names), describe_apex(STANDIN, names)
    assert not real["stand_in"] and standin["stand_in"]  # each subprocess found the right one
    for name in names:
        assert standin["signatures"][name] == real["signatures"][name], name


def test_script_sees_real_apex_and_runs_natively_without_cuda(real_apex, tiny_mnist, tmp_path):
    """Real apex imports (amp and parallel included), but amp needs CUDA: the script must say
    that, not that apex is missing, and train natively to the end. Importing apex must change
    nothing: the run equals one where apex cannot be imported at all. CUDA is hidden, so this
    runs on GPU machines too."""
    args = ["--data-dir", tiny_mnist, "--batch-size", 64, "--log-interval", 5]
    with_apex, without = tmp_path / "with.pt", tmp_path / "without.pt"
    r = run_script(SCRIPT, *args, "--checkpoint", with_apex, "--metrics", tmp_path / "m.jsonl",
                   pythonpath=[real_apex], CUDA_VISIBLE_DEVICES="", allow=str(real_apex))
    line = path_line(r)
    assert line.startswith("path: native PyTorch: apex needs CUDA"), line
    assert "Traceback" not in r.stderr
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["epoch"] == 1 and row["total"] == N_TEST and math.isfinite(row["train_loss"])
    assert "amp" not in load(with_apex)  # no apex state: apex did not run
    r = run_script(SCRIPT, *args, "--checkpoint", without, block="apex", CUDA_VISIBLE_DEVICES="")
    assert path_line(r).startswith("path: native PyTorch: apex does not import")
    assert_same_training_state(load(with_apex), load(without))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_real_apex_end_to_end_on_a_gpu(real_apex, tiny_mnist, tmp_path, opt_level):
    """World size 1 under torchrun, the apex path: --sync-bn (torch's SyncBatchNorm: this build
    has no syncbn extension), amp.initialize, apex DDP; an fp16 overflow forced on step 3 (amp
    must skip it, halve the loss scale, and the script must hold the LR schedule); a checkpoint
    with amp's state after epoch 1; a second run that resumes from it (amp.load_state_dict)
    for epoch 2; then --evaluate.

    Not checked, on purpose: bit-identity with an uninterrupted run. With O2 the checkpoint
    holds the fp16 model weights, not amp's fp32 master weights, so a resume starts from
    rounded weights (see docs/apex.md)."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1")
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    args = ["--data-dir", tiny_mnist, "--batch-size", 64, "--log-interval", 5, "--timeout", 60,
            "--opt-level", opt_level, "--sync-bn", "--epochs", 2, "--checkpoint", ckpt,
            "--metrics", metrics]
    kw = dict(launcher=launcher, pythonpath=[real_apex], allow=str(real_apex), timeout=300,
              gpus=True)
    steps_per_epoch = 10  # 600 tiny training images in batches of 64

    rec1 = tmp_path / "rec1"
    rec1.mkdir()
    r1 = run_script(SCRIPT, *args, "--stop-after", 1, DDP_TEST_INF_GRAD_STEP=3,
                    DDP_TEST_GPU_RECORD=rec1, **kw)
    line = path_line(r1)
    assert line.startswith(f"path: apex ({real_apex}") and f"opt level {opt_level}" in line, line
    # The Python-only build has no syncbn extension: torch's SyncBatchNorm, said at start (apex's
    # Python one returns float32, which O2's half convolutions refuse)
    assert "--sync-bn: torch's nn.SyncBatchNorm, as apex has no syncbn extension" in line, line
    assert "Gradient overflow.  Skipping step" in r1.stdout  # apex's own message
    [worker] = [w for w in read_records(rec1, "gpu") if w["rank"] is not None]
    # every BatchNorm2d was replaced before anything ran the model
    assert "torch.nn.modules.batchnorm.SyncBatchNorm" in worker["modules"], worker["modules"]
    assert "torch.nn.modules.batchnorm.BatchNorm2d" not in worker["modules"]
    assert "apex.parallel.distributed.DistributedDataParallel" in worker["modules"]
    assert "torch.nn.modules.conv.Conv2d float16" in worker["outputs"]  # O1 casts, O2 is fp16

    first = load_on_cpu(ckpt)
    steps = optimizer_steps(first)
    skipped = steps_per_epoch - steps
    assert first["epoch"] == 1 and skipped >= 1
    assert first["scheduler"]["last_epoch"] == steps  # no LR step for a skipped step
    assert first["amp"]["loss_scaler0"]["loss_scale"] == 2.0 ** 16 * 0.5 ** skipped
    assert not first["scaler"]  # apex scales the loss; torch's GradScaler stays off
    common.Net().load_state_dict(first["model"])  # SyncBatchNorm and fp16 weights: plain keys

    r2 = run_script(SCRIPT, *args, **kw)  # the checkpoint exists: resumes by itself
    assert "1 epoch(s) + 0 step(s)" in r2.stdout
    final = load_on_cpu(ckpt)
    steps = optimizer_steps(final)
    assert final["epoch"] == 2 and final["scheduler"]["last_epoch"] == steps
    # The scale continued from the checkpoint: had amp.load_state_dict been skipped, it would
    # have restarted at 2**16 and would not show epoch 1's skips.
    assert final["amp"]["loss_scaler0"]["loss_scale"] == 2.0 ** 16 * 0.5 ** (2 * steps_per_epoch - steps)
    rows = read_metrics(metrics)
    assert [row["epoch"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["train_loss"]) for row in rows)
    assert rows[1]["train_loss"] < rows[0]["train_loss"] and rows[1]["test_acc"] > 80, rows

    run_script(SCRIPT, *args, "--evaluate", "--metrics", tmp_path / "eval.jsonl", **kw)
    [row] = read_metrics(tmp_path / "eval.jsonl")
    assert row["correct"] == rows[1]["correct"]  # the same apex model, the same numerics
