"""dp_baseline.py shares its checkpoints with the DDP scripts, both ways. (That it trains what
spawn_ddp.py trains at world size 1: test_smoke.py; what it refuses: test_bad_input.py.)"""
import pytest
import torch

from conftest import load, read_metrics, run_script

pytestmark = pytest.mark.slow

FLAGS = ["--batch-size", 64, "--log-interval", 5]


def assert_same_model(a, b):
    assert a["epoch"] == b["epoch"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_across_scripts_both_ways(tiny_mnist, tmp_path, straight):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    reference = straight(1, 64, 2) / "c.pt"  # dp_baseline.py, 2 epochs (conftest)
    # DDP (1 process) for epoch 1, DataParallel for epoch 2: the same as DataParallel throughout
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 1, *FLAGS,
               "--epochs", 2, "--stop-after", 1, "--checkpoint", a)
    run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
               "--checkpoint", a, "--resume")
    assert_same_model(load(a), load(reference))
    # DataParallel for epoch 1, DDP with 2 processes for epoch 2
    run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
               "--stop-after", 1, "--checkpoint", b)
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 2, *FLAGS,
               "--epochs", 2, "--checkpoint", b, "--resume", "--metrics", tmp_path / "m.jsonl")
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["epoch"] == 2 and row["world_size"] == 2 and row["test_acc"] > 80
    assert load(b)["epoch"] == 2
