"""Precision that fits the CPU: bfloat16 autocast only pays on a CPU with bf16 instructions
(AVX512_BF16 or AMX on x86, BF16 on ARM); elsewhere it is emulated and slower than fp32.
`--amp auto`, the default, picks bf16 where it pays and fp32 elsewhere, and says which.
The tests decide which CPU the scripts believe they run on (tests/instrument fakes what
torch.cpu.get_capabilities reports), so they do not depend on the machine running them."""
import argparse

import pytest
import torch

from ddpkit import checkpoint, machine
from ddpkit.launch import Place
from conftest import NO_BF16, kept, load, run_mains

BF16 = "avx512_bf16=1,amx_bf16=1"
AUTO = [  # what the CPU has (all four features given): what --amp auto says it picks
    ("avx512_bf16=1,amx_bf16=0,bf16=0,sve_bf16=0", "bf16 autocast, as this CPU has AVX512_BF16"),
    ("avx512_bf16=0,amx_bf16=1,bf16=0,sve_bf16=0", "bf16 autocast, as this CPU has AMX"),
    ("avx512_bf16=0,amx_bf16=0,bf16=1,sve_bf16=0", "bf16 autocast, as this CPU has BF16"),  # ARM
    (NO_BF16, "fp32, as this CPU has no bfloat16 instructions (AVX512_BF16, AMX or ARM BF16)"),
    ("unknown", "fp32, as torch "),  # a torch that cannot tell (2.4)
]


def run(script, *cases):
    """(argv, faked features) pairs through the script's real main(), stopped before training."""
    return run_mains(script, [{"argv": ["--dummy", *argv], "env": {"DDP_TEST_CPU_FEATURES": f}}
                              for argv, f in cases], DDP_TEST_CPU_FEATURES="", block="apex")


def path_line(result):
    return next(ln for ln in result["stdout"].splitlines() if ln.startswith("path: "))


def test_apex_native_path_says_what_each_opt_level_means():
    o1, o0 = run("apex_ddp.py", ([], NO_BF16), (["--opt-level", "O0"], BF16))
    assert all(r["started"] and not r["stderr"].strip() for r in (o1, o0))
    assert path_line(o1).endswith("opt level O1 -> autocast bfloat16 where every CPU of the job "
                                  "computes it, else fp32")
    assert path_line(o0).endswith("opt level O0 -> fp32")


@pytest.mark.parametrize("script", ["dp_baseline.py", "spawn_ddp.py", "torchrun_ddp.py"])
def test_amp_bf16_warns_only_without_bf16_instructions(script):
    without, with_, fp16 = run(script, (["--amp", "bf16"], NO_BF16), (["--amp", "bf16"], BF16),
                               (["--amp", "fp16"], BF16))
    assert without["started"] and with_["started"] and fp16["started"]  # it runs as asked
    [line] = [ln for ln in without["stderr"].splitlines() if ln.strip()]
    assert line.startswith("warning: --amp bf16 on this CPU is slower than fp32: this CPU has "
                           "no bfloat16 instructions")
    assert not with_["stderr"].strip()
    assert fp16["stderr"].startswith("warning: --amp fp16 on this CPU is slower than fp32")


@pytest.mark.parametrize("features,said", AUTO, ids=[f for f, _ in AUTO])
def test_amp_auto_picks_bf16_only_where_the_cpu_computes_it(monkeypatch, features, said):
    """machine.settle_precision itself, through checkpoint.agreed in this process, on the CPU
    the case describes (what torch.cpu.get_capabilities reports, faked as tests/instrument
    does): one process, no checkpoint. (Several processes: test_cluster_safety.py's one
    precision for the job.)"""
    caps = {} if features == "unknown" else {
        name: bool(int(value)) for name, value in (f.split("=") for f in features.split(","))}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps, raising=False)
    args, lines = argparse.Namespace(amp="auto", evaluate=False, checkpoint=None), []
    checkpoint.agreed(args, checkpoint.NO_RESUME, Place(), torch.device("cpu"), lines.append)
    assert args.amp == ("bf16" if said.startswith("bf16") else "none")
    [line] = lines
    assert line.startswith(f"precision: {said}") and line.endswith(
        "(--amp auto; --amp none: fp32)"), line


@pytest.mark.parametrize("script", ["torchrun_ddp.py", pytest.param(
    "apex_ddp.py", marks=pytest.mark.slow)])
def test_amp_auto_trains_in_the_precision_it_picked(preempted, script):
    """The job decides, once, and its processes train so; the checkpoint records the precision
    actually used: the shared runs (conftest.preempted) on a CPU without bfloat16 instructions,
    torchrun_ddp.py with --amp auto, apex_ddp.py's native path at its default O1: fp32, no loss
    scale. (Where every CPU computes bf16: test_a_resume_keeps_the_precision_of_its_run; where
    one does not: test_one_precision_for_the_whole_job.)"""
    d = preempted(script)
    said = [ln for ln in kept(d, "stopped").stdout.splitlines() if ln.startswith("precision: ")]
    assert said == ["precision: fp32, as this CPU has no bfloat16 instructions (AVX512_BF16, AMX "
                    "or ARM BF16) (--amp auto; --amp none: fp32)"], said
    ckpt = load(d / "c.pt")
    assert ckpt["args"]["amp"] == "none" and not ckpt["scaler"]


def test_the_autocast_dtype_reaches_a_dataparallel_replica_only_through_its_module():
    """DataParallel runs each replica's forward in a thread of its own, which enters autocast
    without a dtype (torch/nn/parallel/parallel_apply.py, for CUDA). The dtype is thread-local:
    a thread that enters autocast bare gets the device's default, not the one the main thread
    chose. machine.Autocast enters it with the job's dtype inside the replicated module, and
    so carries it. Shown here with the CPU's autocast, whose default is bfloat16 (CUDA's is
    float16), in a thread of our own doing what parallel_apply does."""
    import threading

    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x, name):
            seen[name] = torch.get_autocast_dtype("cpu")
            return x

    def replica(module, name):
        with torch.autocast("cpu"):  # as parallel_apply enters it: enabled, no dtype
            module(torch.ones(1), name)
    with torch.autocast("cpu", dtype=torch.float16):  # the job's precision
        for module, name in ((Probe(), "bare"),
                             (machine.Autocast(Probe(), torch.float16, "cpu"), "wrapped")):
            thread = threading.Thread(target=replica, args=(module, name))
            thread.start()
            thread.join()
    assert seen == {"bare": torch.bfloat16, "wrapped": torch.float16}
