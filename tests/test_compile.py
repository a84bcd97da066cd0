"""--compile: torch.compile of the DDP-wrapped model (in the order of PyTorch's DDP notes).

What must hold: a compiled run trains the same model as an eager one, up to float rounding;
its checkpoint is a plain common.Net state (no `_orig_mod.` prefix), so it resumes in a run
without --compile and the other way round; without a C++ compiler a CPU run is refused before
it starts. Every test compiles, slowly on 2 cores: all are marked slow.

TOL: inductor fuses and reorders float operations, so a compiled step differs from the eager
one by rounding, and 19 Adam steps per epoch carry that along (Adam divides by the root of
tiny second moments, which scales rounding up). Measured here, one thread per process: on a
2-core AMD EPYC with AVX-512 (torch 2.14.0), 1.5e-4 of a tensor's largest value after epoch 1
and 1.5e-4 after epoch 2 between the two resumed runs; on one with AVX2 only (torch 2.15.0,
2026-11-28), 1.2e-4 and 8.7e-3: inductor's kernels differ with the vector width. TOL is twice
the larger. The control, an eager run with --seed 1 against --seed 0, differs by 2.3.
"""
import shutil

import pytest

import common
from conftest import load, max_rel_diff, run_script

ARGS = ("--nproc-per-node", 2, "--batch-size", 32, "--epochs", 2, "--log-interval", 100,
        "--timeout", 60)
TOL = 2e-2  # of a tensor's largest value (see above)


def train(data, ckpt, *extra, **env):
    return run_script("spawn_ddp.py", "--data-dir", data, *ARGS, "--checkpoint", ckpt, *extra,
                      OMP_NUM_THREADS=1, timeout=300, **env)


@pytest.fixture(scope="module")
def first_epochs(tiny_mnist, tmp_path_factory):
    """Epoch 1 of 2, eager and compiled: (folder, eager.pt, compiled.pt)."""
    tmp = tmp_path_factory.mktemp("compile")
    train(tiny_mnist, tmp / "eager.pt", "--stop-after", 1)
    train(tiny_mnist, tmp / "compiled.pt", "--stop-after", 1, "--compile")
    return tmp, tmp / "eager.pt", tmp / "compiled.pt"


@pytest.mark.slow
def test_compiled_run_saves_a_plain_net_with_the_eager_weights(first_epochs):
    _, eager, compiled = first_epochs
    a, b = load(compiled), load(eager)
    common.Net().load_state_dict(a["model"])  # strict: no _orig_mod. or module. prefix
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (1, 0)
    diff = max_rel_diff(a["model"], b["model"])
    print(f"epoch 1, compiled vs eager: {diff:.2g} relative")
    assert 0 < diff < TOL  # 0 would mean the compiled model never ran


@pytest.mark.slow
def test_resume_across_compile_and_eager(first_epochs, tiny_mnist):
    """Epoch 2 without --compile from the compiled run's checkpoint, and with it from the eager
    run's: both continue, and end with the same model up to rounding."""
    tmp, eager, compiled = first_epochs
    shutil.copy(eager, tmp / "then_compiled.pt")
    shutil.copy(compiled, tmp / "then_eager.pt")
    train(tiny_mnist, tmp / "then_eager.pt", "--resume")
    train(tiny_mnist, tmp / "then_compiled.pt", "--resume", "--compile")
    a, b = load(tmp / "then_compiled.pt"), load(tmp / "then_eager.pt")
    for ckpt in (a, b):
        common.Net().load_state_dict(ckpt["model"])
        assert (ckpt["epoch"], ckpt["step"]) == (2, 0)
    diff = max_rel_diff(a["model"], b["model"])
    print(f"epoch 2, eager then compiled vs compiled then eager: {diff:.2g} relative")
    assert diff < TOL


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
