"""--accumulate N: N micro-batches per optimizer step, gradients all-reduced once per step.

The claim: W processes with --accumulate N train the same model as W*N processes without it.
Same global batch, same samples in each micro-batch (micro-batch k of rank r is what rank
r + W*k of W*N gets), same weighting, one all-reduce per step. Only BatchNorm's running
statistics differ (README, "Gradient accumulation"): they are buffers, not trained, and each
process updates its own with every forward.

All runs use one thread per process, so that a one-process run and a two-process run do the
same arithmetic in each convolution. What may remain is the order in which the micro-batches'
gradients are added (in .grad by autograd, or by the all-reduce): with two it is a + b either
way, and the 1x2 and 2x1 runs below ended bit-identical here (largest difference 0.0, on a
2-core AMD EPYC). With more, float addition in another order differs by rounding, about 1e-7
relative per step, which 19 Adam steps keep far inside TOL; the control without --accumulate
differs by 0.16 relative.
"""
import pytest
import torch

from conftest import ROOT, load, max_rel_diff, read_records, run_script

TORCHRUN = ("-m", "torch.distributed.run", "--standalone")
STANDIN = ROOT / "tests" / "standin"
ARGS = ("--batch-size", 32, "--epochs", 1, "--log-interval", 100, "--timeout", 30)
TOL = dict(rtol=1e-5, atol=1e-7)


def run(script, data, procs, *extra, launcher=(), **env):
    """One training run at `procs` processes; the script's own launcher flag or torchrun's."""
    if script == "dp_baseline.py":  # one process, no --timeout
        assert procs == 1
        extra = ARGS[:-2] + extra
    elif script == "spawn_ddp.py":
        extra = (*ARGS, "--nproc-per-node", procs, *extra)
    else:
        extra = ARGS + extra
        launcher = (*TORCHRUN, f"--nproc-per-node={procs}")
    return run_script(script, "--data-dir", data, *extra, launcher=launcher,
                      OMP_NUM_THREADS=1, timeout=240, **env)


def trained(state):
    """The trained parameters, without BatchNorm's running statistics."""
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@pytest.fixture(scope="module")
def two_and_one(tiny_mnist, tmp_path_factory):
    """spawn_ddp.py with 2 processes (what accumulating 2 must equal; every launch style trains
    the same), and with 1 process without --accumulate (the control)."""
    d = tmp_path_factory.mktemp("reference")
    run("spawn_ddp.py", tiny_mnist, 2, "--checkpoint", d / "two.pt")
    run("spawn_ddp.py", tiny_mnist, 1, "--checkpoint", d / "one.pt")
    return load(d / "two.pt"), load(d / "one.pt")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py", "dp_baseline.py"])
def test_accumulating_two_equals_twice_the_processes(tiny_mnist, tmp_path, two_and_one, script):
    run(script, tiny_mnist, 1, "--accumulate", 2, "--checkpoint", tmp_path / "acc.pt")
    acc, (two, one) = load(tmp_path / "acc.pt"), two_and_one
    assert acc["optimizer"]["state"][0]["step"] == two["optimizer"]["state"][0]["step"] == 19

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


def allreduces_per_step(log_dir):
    """For each rank: how many gradient all-reduces ran before each optimizer step."""
    counts = {}
    for row in read_records(log_dir, "allreduce"):
        per_rank = counts.setdefault(row["rank"], [0])
        if row["event"] == "allreduce":
            per_rank[-1] += 1
        else:
            per_rank.append(0)
    return {rank: c[:-1] for rank, c in counts.items()}  # the last count: after the last step


@pytest.mark.slow
@pytest.mark.parametrize("script,extra,env", [
    ("spawn_ddp.py", (), {}),  # PyTorch's DDP, as every native path has it
    ("apex_ddp.py", ("--opt-level", "O0"), {"pythonpath": [STANDIN]}),  # apex's DDP (stand-in)
], ids=["spawn", "apex-standin"])
def test_one_allreduce_per_optimizer_step(tiny_mnist, tmp_path, script, extra, env):
    """DDP all-reduces each bucket once per step: the same count per step with --accumulate 4
    as without it. A forward outside no_sync() would all-reduce in every micro-batch."""
    seen = {}
    for n in (1, 4):
        d = tmp_path / f"acc{n}"
        d.mkdir()
        run(script, tiny_mnist, 2, "--accumulate", n, *extra, "--stop-after", 1,
            DDP_TEST_ALLREDUCE_LOG=d, **env)
        seen[n] = allreduces_per_step(d)
    base = seen[1][0]
    assert len(base) == 19 and base[0] > 0 and len(set(base)) == 1  # every step, same buckets
    for n, per_rank in seen.items():
        assert sorted(per_rank) == [0, 1]
        assert per_rank[0] == per_rank[1] == base, f"--accumulate {n}: {per_rank}"


@pytest.mark.slow
def test_apex_path_keeps_replicas_equal(tiny_mnist, tmp_path):
    """apex's amp moves earlier gradients out of .grad before each backward unless told
    `delay_unscale=True`; with the all-reduce switched off for those micro-batches, the
    replicas would each add back their own, never averaged, and drift apart. With the stand-in
    (which moves them as apex does), both ranks must end with the same model, and the same as
    the native path's."""
    for name, env in (("apex", {"pythonpath": [STANDIN]}), ("native", {"block": "apex"})):
        d = tmp_path / name
        d.mkdir()
        run("apex_ddp.py", tiny_mnist, 2, "--accumulate", 2, "--opt-level", "O0", record=d,
            **env)
    apex = [torch.load(tmp_path / "apex" / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    native = torch.load(tmp_path / "native" / "final-rank0.pt", weights_only=True)
    for k in trained(apex[0]):
        assert torch.equal(apex[0][k], apex[1][k]), f"{k}: the two ranks' models differ"
        torch.testing.assert_close(apex[0][k], native[k], **TOL, msg=lambda m: f"{k}: {m}")

