"""apex_ddp.py: the native path for real (gloo, 2 processes), and the apex path's control flow
with a STAND-IN apex package (tests/standin: not apex, see its README). Real apex needs CUDA
and a source build; no test here runs it."""

import pytest

from conftest import ROOT, assert_same_training_state, load, read_metrics, run_script

SCRIPT = "apex_ddp.py"
STANDIN = ROOT / "tests" / "standin"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
LEGACY = ("-m", "torch.distributed.launch", "--nproc-per-node=2")
BF16 = "avx512_bf16=1"  # a CPU with bfloat16 instructions (tests/instrument fakes it)


def tiny(data, *extra):
    return ["--data-dir", data, "--batch-size", 64, "--log-interval", 5, "--timeout", 30, *extra]


def path_lines(result):
    return [ln for ln in result.stdout.splitlines() if ln.startswith("path: ")]


@pytest.fixture(scope="module")
def native_o0(tiny_mnist, tmp_path_factory):
    """The native path in fp32 (O0), 2 epochs: what the other runs are compared with."""
    d = tmp_path_factory.mktemp("native_o0")
    r = run_script(SCRIPT, *tiny(tiny_mnist, "--epochs", 2, "--opt-level", "O0",
                                 "--checkpoint", d / "c.pt"), launcher=TORCHRUN, block="apex")
    return d / "c.pt", r


@pytest.mark.slow
def test_native_path_says_why_and_matches_torchrun_ddp(native_o0, straight):
    """Without apex the script runs torchrun_ddp.py's loop: at O0, bit for bit."""
    ckpt, r = native_o0
    [line] = path_lines(r)
    assert line.startswith("path: native PyTorch: apex does not import (")
    assert "Traceback" not in r.stderr
    assert_same_training_state(load(straight(2, 64, 2) / "c.pt"), load(ckpt))  # torchrun_ddp.py


@pytest.mark.slow
def test_native_path_checkpoints_and_resumes(tiny_mnist, tmp_path):
    """Default O1 natively on a CPU with bf16 instructions = autocast(bfloat16), no GradScaler
    (the CPU's features are faked: see test_precision.py for a CPU without them). The first
    run finds an unrelated package named `apex` (what `pip install apex` gives you) and must
    say so and carry on; the second resumes from the checkpoint by itself."""
    fake = tmp_path / "unrelated" / "apex"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""Not NVIDIA apex: a package that shares the name."""\n')
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    args = tiny(tiny_mnist, "--epochs", 2, "--checkpoint", ckpt, "--metrics", metrics)
    r1 = run_script(SCRIPT, *args, "--stop-after", 1, launcher=TORCHRUN,
                    pythonpath=[fake.parent], DDP_TEST_CPU_FEATURES=BF16)
    [line] = path_lines(r1)
    assert "apex does not import (ImportError: cannot import name 'amp'" in line
    first = load(ckpt)
    assert first["args"]["amp"] == "bf16" and not first["scaler"] and "amp" not in first
    r2 = run_script(SCRIPT, *args, launcher=TORCHRUN, block="apex",  # resumes by itself
                    DDP_TEST_CPU_FEATURES=BF16)
    assert "loaded" in r2.stdout and "1 epoch(s) + 0 step(s)" in r2.stdout
    rows = read_metrics(metrics)
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]  # finite, and still learning
    assert "Traceback" not in r1.stderr + r2.stderr


@pytest.mark.slow
def test_apex_path_control_flow_with_the_standin(tiny_mnist, tmp_path, native_o0):
    """The stand-in logs every apex call. Checked: apex's documented order
    (convert_syncbn_model -> amp.initialize -> [checkpoint load, amp.load_state_dict] ->
    apex DDP with delay_allreduce=True), backward() inside amp.scale_loss on every step, and
    amp.state_dict() in the checkpoint. The stand-in's loss scale is a power of two and its DDP
    is PyTorch's, so the result must equal the native fp32 run bit for bit."""
    log, ckpt = tmp_path / "apex.jsonl", tmp_path / "c.pt"
    args = tiny(tiny_mnist, "--epochs", 2, "--sync-bn", "--checkpoint", ckpt)
    r1 = run_script(SCRIPT, *args, "--stop-after", 1, launcher=TORCHRUN, pythonpath=[STANDIN],
                    APEX_STANDIN_LOG=log)
    [line] = path_lines(r1)
    assert line.startswith("path: apex (") and "opt level O1" in line
    assert load(ckpt)["amp"] == {"loss_scaler0": {"loss_scale": 16.0, "unskipped": 10}}
    # the resume, under the legacy launcher this time
    run_script(SCRIPT, *args, launcher=LEGACY, pythonpath=[STANDIN], APEX_STANDIN_LOG=log,
               allow="torch.distributed.launch is deprecated")

    calls = read_metrics(log)  # one JSON object per line, like --metrics
    runs = {}
    for c in calls:
        runs.setdefault(c["pid"], []).append(c)
    assert len(runs) == 4  # 2 processes x 2 runs
    for pid, cs in runs.items():
        names = [c["call"] for c in cs if c["call"] != "amp.scale_loss"]
        resumed = "amp.load_state_dict" in names
        assert names == ["parallel.convert_syncbn_model", "amp.initialize",
                         *(["amp.load_state_dict"] if resumed else []),
                         "parallel.DistributedDataParallel"], names
        by = {c["call"]: c for c in cs}
        assert by["amp.initialize"]["opt_level"] == "O1"
        assert by["amp.initialize"]["optimizer_steps"] == 0  # before any optimizer state
        assert by["parallel.DistributedDataParallel"]["delay_allreduce"] is True
        steps = [c for c in cs if c["call"] == "amp.scale_loss"]
        assert len(steps) == 10 and all(c["backward_inside"] for c in steps)
        if resumed:
            assert by["amp.load_state_dict"]["state"]["loss_scaler0"]["unskipped"] == 10
    final = load(ckpt)
    assert final["amp"]["loss_scaler0"]["unskipped"] == 20
    assert_same_training_state(load(native_o0[0]), final)


def test_error_amp_flag_is_refused(tiny_mnist):
    r = run_script(SCRIPT, "--data-dir", tiny_mnist, "--amp", "bf16", check=False, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--opt-level" in lines[0], r.stderr
