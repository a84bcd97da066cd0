"""dp_baseline.py: runs on CPU, matches spawn_ddp.py at world size 1, shares its checkpoints."""
import torch

from conftest import N_TEST, load, read_metrics, run_script

FLAGS = ["--batch-size", 64, "--lr", 0.02, "--log-interval", 5]


def assert_same_model(a, b):
    assert a["epoch"] == b["epoch"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_dp_trains_on_cpu_like_ddp_at_world_size_1(tiny_mnist, tmp_path):
    """Same seed and global batch: DataParallel (a pass-through on CPU) and DDP with one
    process take exactly the same steps."""
    dp, ddp = tmp_path / "dp.pt", tmp_path / "ddp.pt"
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
                   "--checkpoint", dp, "--metrics", tmp_path / "dp.jsonl")
    assert "no GPU" in r.stdout
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 1, *FLAGS,
               "--epochs", 2, "--checkpoint", ddp, "--metrics", tmp_path / "ddp.jsonl")
    rows = read_metrics(tmp_path / "dp.jsonl")
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["total"] == N_TEST and rows[-1]["test_acc"] > 80
    assert [r["correct"] for r in rows] == [r["correct"] for r in read_metrics(tmp_path / "ddp.jsonl")]
    assert not any(k.startswith("module.") for k in load(dp)["model"])
    assert_same_model(load(dp), load(ddp))


def test_resume_across_scripts_both_ways(tiny_mnist, tmp_path):
    straight, a, b = tmp_path / "straight.pt", tmp_path / "a.pt", tmp_path / "b.pt"
    run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
               "--checkpoint", straight)
    # DDP (1 process) for epoch 1, DataParallel for epoch 2: the same as DataParallel throughout
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 1, *FLAGS,
               "--epochs", 2, "--stop-after", 1, "--checkpoint", a)
    run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
               "--checkpoint", a, "--resume")
    assert_same_model(load(a), load(straight))
    # DataParallel for epoch 1, DDP with 2 processes for epoch 2
    run_script("dp_baseline.py", "--data-dir", tiny_mnist, *FLAGS, "--epochs", 2,
               "--stop-after", 1, "--checkpoint", b)
    run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 2, *FLAGS,
               "--epochs", 2, "--checkpoint", b, "--resume", "--metrics", tmp_path / "m.jsonl")
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["epoch"] == 2 and row["world_size"] == 2 and row["test_acc"] > 80
    assert load(b)["epoch"] == 2


def test_dp_refuses_sync_bn(tiny_mnist):
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--sync-bn", check=False)
    assert r.returncode != 0 and r.stderr.strip().startswith("error: --sync-bn")
    assert len(r.stderr.strip().splitlines()) == 1
