"""apex_ddp.py: the native path for real (gloo, 2 processes), and the apex path's control flow
with a STAND-IN apex package (tests/standin: not apex, see its README). Real apex needs CUDA
and a source build; no test here runs it."""

import pytest

from conftest import ROOT, TORCHRUN2, TRAIN, assert_same_training_state, final, kept, load, \
    read_metrics, read_records, run_script

SCRIPT = "apex_ddp.py"
STANDIN = ROOT / "tests" / "standin"
LEGACY = ("-m", "torch.distributed.launch", "--nproc-per-node=2")
BF16 = "avx512_bf16=1"  # a CPU with bfloat16 instructions (tests/instrument fakes it)
CONV = "torch.nn.modules.conv.Conv2d"


def tiny(data, *extra):
    return ["--data-dir", data, *TRAIN, "--log-interval", 5, "--timeout", 30, *extra]


def path_lines(result):
    return [ln for ln in result.stdout.splitlines() if ln.startswith("path: ")]


@pytest.mark.slow
def test_native_path_says_why_and_matches_torchrun_ddp(preempted, straight):
    """Without apex the script runs torchrun_ddp.py's loop (its shared run, conftest.preempted,
    at its default O1: fp32 on a CPU without bfloat16): it says why, and trains torchrun_ddp.py's
    model, bit for bit."""
    d = preempted(SCRIPT)
    [line] = path_lines(kept(d, "stopped"))
    assert line.startswith("path: native PyTorch: apex does not import (")
    assert "Traceback" not in kept(d, "resumed").stderr
    assert_same_training_state(load(straight(2) / "c.pt"), final(d))


@pytest.mark.slow
def test_a_resume_keeps_the_precision_of_its_run(tiny_mnist, tmp_path):
    """apex_ddp.py's native path (torchrun_ddp.py's training) at its default O1, --amp auto's:
    begun where every CPU computes bf16 (the CPU's features are faked), the job trains in bf16,
    autocast and no GradScaler, says so once and the checkpoint records it (fp32 where one does
    not: test_one_precision_for_the_whole_job). Continued by itself on CPUs without bfloat16
    instructions, it goes on in bf16, says so, and warns that this CPU is slower at it; bf16
    saves no loss scale (only fp16 needs one: test_the_schedule_waits_for_a_step_that_fp16_skipped).
    The first run finds an unrelated package named `apex` (what `pip install apex` gives you)
    and must say so and carry on."""
    fake = tmp_path / "unrelated" / "apex"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""Not NVIDIA apex: a package that shares the name."""\n')
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    args = tiny(tiny_mnist, "--checkpoint", ckpt, "--metrics", metrics)
    r1 = run_script(SCRIPT, *args, "--stop-after", 1, launcher=TORCHRUN2,
                    pythonpath=[fake.parent], DDP_TEST_CPU_FEATURES=BF16)
    [line] = path_lines(r1)
    assert "apex does not import (ImportError: cannot import name 'amp'" in line
    said = [ln for ln in r1.stdout.splitlines() if ln.startswith("precision: ")]
    assert len(said) == 1 and said[0].startswith("precision: bf16 autocast, as this CPU has "), said
    first = load(ckpt)
    assert first["args"]["amp"] == "bf16" and not first["scaler"] and "amp" not in first
    r2 = run_script(SCRIPT, *args, launcher=TORCHRUN2, block="apex",  # resumes by itself
                    DDP_TEST_GPU_RECORD=tmp_path)
    assert "loaded" in r2.stdout and "1 epoch(s) + 0 step(s)" in r2.stdout
    assert "precision: bf16 autocast, the precision the checkpoint was trained in (--amp auto)" \
        in r2.stdout, r2.stdout
    assert "warning: --amp bf16 on this CPU is slower than fp32" in r2.stderr, r2.stderr
    ranks = [r for r in read_records(tmp_path, "gpu") if r["rank"] is not None]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(f"{CONV} bfloat16" in r["outputs"] for r in ranks), ranks
    ckpt = load(ckpt)
    assert ckpt["args"]["amp"] == "bf16" and not ckpt["scaler"]
    rows = read_metrics(metrics)
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]  # finite, and still learning
    assert "Traceback" not in r1.stderr + r2.stderr


@pytest.mark.slow
def test_apex_path_control_flow_with_the_standin(tiny_mnist, tmp_path, straight):
    """The stand-in logs every apex call. Checked: apex's documented order
    (convert_syncbn_model -> amp.initialize -> [checkpoint load, amp.load_state_dict] ->
    apex DDP with delay_allreduce=True), backward() inside amp.scale_loss on every step, and
    amp.state_dict() in the checkpoint. The stand-in's loss scale is a power of two and its DDP
    is PyTorch's, so the result must equal the native fp32 run (torchrun_ddp.py's,
    conftest.straight) bit for bit."""
    log, ckpt = tmp_path / "apex.jsonl", tmp_path / "c.pt"
    args = tiny(tiny_mnist, "--sync-bn", "--checkpoint", ckpt)
    r1 = run_script(SCRIPT, *args, "--stop-after", 1, launcher=TORCHRUN2, pythonpath=[STANDIN],
                    APEX_STANDIN_LOG=log)
    [line] = path_lines(r1)
    assert line.startswith("path: apex (") and "opt level O1" in line
    assert load(ckpt)["amp"] == {"loss_scaler0": {"loss_scale": 16.0, "unskipped": 19}}
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
        assert len(steps) == 19 and all(c["backward_inside"] for c in steps)
        if resumed:
            assert by["amp.load_state_dict"]["state"]["loss_scaler0"]["unskipped"] == 19
    final_state = load(ckpt)
    assert final_state["amp"]["loss_scaler0"]["unskipped"] == 38
    assert_same_training_state(load(straight(2) / "c.pt"), final_state)
