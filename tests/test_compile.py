"""--compile: torch.compile of the DDP-wrapped model (in the order of PyTorch's DDP notes).

What must hold: a compiled run trains the same model as an eager one, up to float rounding;
its checkpoint is a plain common.Net state (no `_orig_mod.` prefix), so it resumes in a run
without --compile and the other way round; without a C++ compiler a CPU run is refused before
it starts. One run compiles (slowly on 2 cores: inductor builds its C++ kernels), between two
eager ones.

TOL: inductor fuses and reorders float operations, so a compiled step differs from the eager
one by rounding, and Adam steps carry that along (Adam divides by the root of tiny second
moments, which scales rounding up). Measured here, one thread per process: on a 2-core AMD EPYC
with AVX-512 (torch 2.14.0), 1.5e-4 of a tensor's largest value after epoch 1 and 1.5e-4 after
epoch 2 between two runs that each compiled one epoch; on one with AVX2 only (torch 2.15.0,
2026-11-28), 1.2e-4 and 8.7e-3: inductor's kernels differ with the vector width. TOL is twice
the larger. The control, an eager run with --seed 1 against --seed 0, differs by 2.3.
"""
import shutil
import sys

import pytest

import common
from conftest import ROOT, TRAIN, load, max_rel_diff, run_script, script_env, sigterm_when

ARGS = ("--nproc-per-node", 2, *TRAIN, "--log-interval", 1, "--timeout", 60)
TOL = 2e-2  # of a tensor's largest value (see above)


@pytest.mark.slow
def test_resume_across_compile_and_eager(tiny_mnist, tmp_path, first_epoch, straight):
    """Epoch 1 eager (conftest.first_epoch); epoch 2 resumed with --compile and stopped by
    SIGTERM in its middle: the compiled run's snapshot is a plain common.Net; then the rest of
    epoch 2 resumed without --compile. It ends where the eager run that nothing interrupted ends
    (conftest.straight), up to rounding, and not exactly (the compiled steps ran). Why 40 s:
    inductor builds the compiled model's C++ in each process, into a cache of its own, cold as at
    a user's first --compile (a warm cache skips the compile workers, which once hung the end)."""
    ckpt = tmp_path / "c.pt"
    shutil.copy(first_epoch, ckpt)
    cmd = [sys.executable, str(ROOT / "spawn_ddp.py"), "--data-dir", str(tiny_mnist),
           *map(str, ARGS), "--checkpoint", str(ckpt), "--resume"]
    cold = script_env(OMP_NUM_THREADS=1, TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor")
    r = sigterm_when([*cmd, "--compile"], "epoch 2/2 step 5/", cold, timeout=300)
    assert r.returncode == 143 and "loaded" in r.stdout, r.stderr
    compiled = load(ckpt)
    assert compiled["epoch"] == 1 and compiled["step"] >= 5 and compiled["args"]["compile"]
    common.Net().load_state_dict(compiled["model"])  # strict: no _orig_mod. or module. prefix
    run_script("spawn_ddp.py", *cmd[2:], OMP_NUM_THREADS=1, timeout=300)
    final = load(ckpt)
    common.Net().load_state_dict(final["model"])
    assert (final["epoch"], final["step"]) == (2, 0)
    diff = max_rel_diff(final["model"], load(straight(2) / "c.pt")["model"])
    print(f"epoch 2, compiled in part vs eager: {diff:.2g} relative")
    assert 0 < diff < TOL  # 0 would mean the compiled model never ran


@pytest.mark.slow
def test_compile_without_a_cpp_compiler_is_refused(tiny_mnist, tmp_path):
    """inductor builds CPU kernels with $CXX, else g++ (torch._inductor.cpp_builder): a CXX that
    does not exist stands for a machine without one."""
    p = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--compile", check=False,
                   CXX=str(tmp_path / "no-such-g++"), timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --compile"), p.stderr
    assert "processes" not in p.stdout  # refused before any worker started
