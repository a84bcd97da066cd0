"""--accumulate N: N micro-batches per optimizer step, gradients all-reduced once per step.

The claim: W processes with --accumulate N train the same model as W*N processes without it.
Same global batch, same samples in each micro-batch (micro-batch k of rank r is what rank
r + W*k of W*N gets), same weighting, one all-reduce per step. Only BatchNorm's running
statistics differ (README, "Gradient accumulation"): they are buffers, not trained, and each
process updates its own with every forward. (One all-reduce per step with PyTorch's DDP, and
one reduce-scatter per unit with FSDP: test_smoke.py's
test_one_gradient_reduction_per_optimizer_step.)

All runs use one thread per process, so that a one-process run and a two-process run do the
same arithmetic in each convolution. What may remain is the order in which the micro-batches'
gradients are added (in .grad by autograd, or by the all-reduce): with two it is a + b either
way, and the 1x2 and 2x1 runs below ended bit-identical here (largest difference 0.0, on a
2-core AMD EPYC). With more, float addition in another order differs by rounding, about 1e-7
relative per step, which 38 Adam steps keep far inside TOL; the control without --accumulate
differs by 0.16 relative.
"""
import pytest
import torch

from conftest import ROOT, TRAIN, load, max_rel_diff, read_records, run_script

STANDIN = ROOT / "tests" / "standin"
ARGS = (*TRAIN, "--log-interval", 100)  # 19 steps an epoch, 2 epochs
TOL = dict(rtol=1e-5, atol=1e-7)


def run(script, data, procs, *extra, **env):
    """One training run at `procs` processes (conftest.command), one thread each."""
    return run_script(script, "--data-dir", data, *ARGS, *extra, nproc=procs, OMP_NUM_THREADS=1,
                      timeout=240, **env)


def trained(state):
    """The trained parameters, without BatchNorm's running statistics."""
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py", "dp_baseline.py"])
def test_accumulating_two_equals_twice_the_processes(tiny_mnist, tmp_path, straight, script):
    """One process with --accumulate 2 against conftest.straight's 2 processes (torchrun_ddp.py,
    whose training every launch style trains) and, as the control, its one process without
    --accumulate (dp_baseline.py)."""
    run(script, tiny_mnist, 1, "--accumulate", 2, "--checkpoint", tmp_path / "acc.pt")
    acc, two, one = load(tmp_path / "acc.pt"), load(straight(2) / "c.pt"), \
        load(straight(1) / "c.pt")
    assert acc["optimizer"]["state"][0]["step"] == two["optimizer"]["state"][0]["step"] == 38

    a, b = trained(acc["model"]), trained(two["model"])
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=lambda m: f"{k}: {m}")
    # The control: one process with the whole batch in one forward (BatchNorm normalises over
    # 32 samples, not 16) ends far outside the tolerance, so the comparison can fail.
    assert max_rel_diff(trained(one["model"]), b) > 100 * TOL["rtol"]
    # BatchNorm's running statistics do differ: rank 0 of two processes saw only its own
    # micro-batches, the accumulating process saw both ranks' (docs/training.md says why).
    assert not torch.allclose(acc["model"]["features.1.running_mean"],
                              two["model"]["features.1.running_mean"], **TOL)


@pytest.mark.slow
def test_apex_path_keeps_replicas_equal(tiny_mnist, tmp_path, straight):
    """apex's amp moves earlier gradients out of .grad before each backward unless told
    `delay_unscale=True`; with the all-reduce switched off for those micro-batches
    (disable_allreduce, apex's no_sync), the replicas would each add back their own, never
    averaged, and drift apart. With the stand-in (which moves them as apex does), 2 processes
    with --accumulate 2: both ranks end with the same model, and with the native path's
    (torchrun_ddp.py's, conftest.straight) up to rounding; the all-reduces of each step come
    after its last micro-batch only."""
    rec = tmp_path / "rec"
    rec.mkdir()
    run("apex_ddp.py", tiny_mnist, 2, "--accumulate", 2, "--opt-level", "O0", record=rec,
        pythonpath=[STANDIN], DDP_TEST_ALLREDUCE_LOG=rec)
    apex = [torch.load(rec / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    native = torch.load(straight(2, accumulate=2) / "rec" / "final-rank0.pt", weights_only=True)
    for k in trained(apex[0]):
        assert torch.equal(apex[0][k], apex[1][k]), f"{k}: the two ranks' models differ"
        torch.testing.assert_close(apex[0][k], native[k], **TOL, msg=lambda m: f"{k}: {m}")
    # and apex's DDP all-reduces each bucket once per step, after the last micro-batch's loss:
    # the same number in every step and process (PyTorch's DDP and FSDP: test_smoke.py)
    per_step = {}
    for rank in (0, 1):
        seq = " ".join(r["event"] for r in read_records(rec, "allreduce") if r["rank"] == rank)
        steps = [step.split() for step in seq.split("step")[:-1]]
        assert len(steps) == 38
        for step in steps:
            assert step[:2] == ["loss", "loss"] and set(step[2:]) == {"allreduce"}, step
        per_step[rank] = {len(step) for step in steps}
    assert per_step[0] == per_step[1] and len(per_step[0]) == 1, per_step
