"""The learning rate the optimizer really gets follows --lr-scaling, at several global batches
and world sizes. tests/instrument records the LR of every optimizer step on every rank."""
import math

import pytest

from conftest import read_records, run_script

pytestmark = pytest.mark.slow

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
RULES = {"sqrt": lambda k: math.sqrt(k), "linear": lambda k: k, "none": lambda k: 1.0}
CASES = [  # script, launcher, flags, world size, global batch, rule, --lr
    ("dp_baseline.py", (), [], 1, 64, "sqrt", 0.01),
    ("spawn_ddp.py", (), ["--nproc-per-node", 3], 3, 192, "linear", 0.01),
    ("torchrun_ddp.py", TORCHRUN, [], 2, 1024, "sqrt", 0.02),
    ("torchrun_ddp.py", TORCHRUN, [], 2, 64, "none", 0.003),
]


@pytest.mark.parametrize("script,launcher,flags,world,batch,rule,lr", CASES,
                         ids=[f"{c[0]}-x{c[3]}-batch{c[4]}-{c[5]}" for c in CASES])
def test_peak_lr_follows_the_rule(tiny_mnist, tmp_path, script, launcher, flags, world, batch,
                                  rule, lr):
    r = run_script(script, "--data-dir", tiny_mnist, "--epochs", 2, "--batch-size", batch,
                   "--lr", lr, "--lr-scaling", rule, *flags, launcher=launcher, record=tmp_path)
    peak = lr * RULES[rule](batch / 256)
    by_rank = {}
    for row in read_records(tmp_path, "lr"):
        by_rank.setdefault(row["rank"], []).append(row["lr"])
    assert sorted(by_rank) == list(range(world))
    lrs = by_rank[0]
    assert all(by_rank[k] == lrs for k in by_rank)  # every process steps with the same LR
    assert math.isclose(max(lrs), peak, rel_tol=1e-12), (max(lrs), peak)
    assert lrs[0] < peak or len(lrs) <= 2  # warmup starts below the peak
    said = f"LR {lr:g} at batch 256 -> {peak:.4g} at {batch} ("
    assert said in r.stdout, r.stdout
