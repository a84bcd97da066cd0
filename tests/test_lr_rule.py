"""The learning rate follows --lr-scaling: at several global batches, the schedule's peak is --lr
times the rule's factor of batch / 256, reached after a warmup that starts below it. The
arithmetic is checked here, in this process, with the scripts' own parser and recipe; that
the optimizer of a real run gets it, the same in every process, on the records of a shared
run (tests/instrument records the LR of every optimizer step on every rank)."""
import math

import pytest

import common
from conftest import kept, read_records
from ddpkit import flags

RULES = {"sqrt": lambda k: math.sqrt(k), "linear": lambda k: k, "none": lambda k: 1.0}
CASES = [  # global batch, rule, --lr
    (64, "sqrt", 0.01), (192, "linear", 0.01), (1024, "sqrt", 0.02), (64, "none", 0.003)]


@pytest.mark.parametrize("batch,rule,lr", CASES, ids=[f"batch{b}-{r}" for b, r, _ in CASES])
def test_peak_lr_follows_the_rule(batch, rule, lr):
    """The schedule of 2 epochs of the tiny MNIST (600 samples) at that batch, step by step."""
    args = flags.parse_args("", "dp", ["--dummy", "--epochs", "2", "--batch-size", str(batch),
                                       "--lr", str(lr), "--lr-scaling", rule])
    peak = lr * RULES[rule](batch / 256)
    assert math.isclose(common.peak_lr(args), peak, rel_tol=1e-12)
    steps = math.ceil(600 / batch)
    optimizer = common.make_optimizer(common.make_model(args), args)
    scheduler = common.make_scheduler(optimizer, args, steps)
    lrs = []
    for _ in range(2 * steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert math.isclose(max(lrs), peak, rel_tol=1e-12), (max(lrs), peak)
    assert lrs[0] < peak or len(lrs) <= 2  # warmup starts below the peak


def test_every_process_steps_with_the_lr_it_says(straight):
    """A 2-process run of conftest.straight (global batch 32, --lr 0.01, the square-root rule;
    --accumulate 2): every process's optimizer steps with the same LR at each step, warming up
    to the peak the rule gives, which rank 0 prints."""
    d = straight(2, accumulate=2)
    by_rank = {}
    for row in read_records(d / "rec", "lr"):
        by_rank.setdefault(row["rank"], []).append(row["lr"])
    assert sorted(by_rank) == [0, 1] and by_rank[0] == by_rank[1] and len(by_rank[0]) == 38
    peak = 0.01 * math.sqrt(32 / 256)
    assert math.isclose(max(by_rank[0]), peak, rel_tol=1e-12) and by_rank[0][0] < peak
    assert f"LR 0.01 at batch 256 -> {peak:.4g} at 32 (square-root rule, for Adam)" in \
        kept(d, "run").stdout
