"""The README's lesson: lesson/one_process.py, a plain training loop, and lesson/ddp.py, the
same loop made data-parallel under torchrun. Both train; the DDP version's processes each
take a disjoint shard, reshuffled every epoch, end with the same weights, count every test
sample once, and leave one checkpoint written by one process that a plain model loads. The
lesson needs common.py alone."""
import argparse
import re
import sys

import torch

import common
from conftest import N_TEST, ROOT, load, read_records, run_script

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
LINE = re.compile(r"epoch (\d+) train_loss ([\d.]+) test_acc ([\d.]+) correct (\d+) total (\d+)$")


def epochs(stdout):
    return [LINE.match(line).groups() for line in stdout.splitlines() if line.startswith("epoch")]


def test_one_process_trains_and_saves_a_plain_model(tiny_mnist, tmp_path):
    r = run_script("lesson/one_process.py", "--data-dir", tiny_mnist, "--epochs", 2,
                   "--batch-size", 32, "--checkpoint", tmp_path / "c.pt", timeout=120)
    rows = epochs(r.stdout)
    assert [e for e, *_ in rows] == ["1", "2"], r.stdout
    assert int(rows[-1][4]) == N_TEST and float(rows[-1][2]) > 80, r.stdout  # learnable digits
    common.Net().load_state_dict(load(tmp_path / "c.pt")["model"])  # strict: plain keys


def test_ddp_shards_reshuffles_agrees_and_writes_once(tiny_mnist, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    r = run_script("lesson/ddp.py", "--data-dir", tiny_mnist, "--epochs", 2, "--batch-size",
                   32, "--checkpoint", tmp_path / "c.pt", launcher=TORCHRUN, record=rec,
                   timeout=180, OMP_NUM_THREADS=1)
    rows = epochs(r.stdout)  # printed by rank 0 alone
    assert [e for e, *_ in rows] == ["1", "2"], r.stdout
    assert all(int(total) == N_TEST for *_, total in rows), rows  # each test sample once
    assert float(rows[-1][2]) > 80, rows
    shards = {(s["epoch"], s["rank"]): s["indices"] for s in read_records(rec, "sampler")}
    assert set(shards) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for epoch in (0, 1):
        assert not set(shards[epoch, 0]) & set(shards[epoch, 1])  # disjoint (600 divides by 2)
    assert shards[0, 0] != shards[1, 0]  # set_epoch: a new order each epoch
    finals = [load(rec / f"final-rank{k}.pt") for k in (0, 1)]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])  # one model
    saves = read_records(rec, "save")
    assert len({s["pid"] for s in saves if "final-rank" not in s["path"]}) == 1, saves
    saved = load(tmp_path / "c.pt")["model"]
    common.Net().load_state_dict(saved)  # the plain model's keys, no "module." prefix
    assert all(torch.equal(saved[k], finals[0][k]) for k in saved)  # the last weights


def test_three_processes_report_the_whole_test_set_and_the_mean_loss(tmp_path):
    """3 processes on MNIST's synthetic data (--dummy: 10,000 test samples, which 3 does not
    divide): the printed counts are the saved model's on the whole test set, evaluated here in
    one process, and the printed loss is the mean of every process's training losses, weighted
    by their samples (recorded as each process computed them)."""
    rec = tmp_path / "rec"
    rec.mkdir()
    r = run_script("lesson/ddp.py", "--dummy", "--batch-size", 600, "--checkpoint",
                   tmp_path / "c.pt", launcher=(*TORCHRUN[:-1], "--nproc-per-node=3"),
                   record=rec, timeout=300, OMP_NUM_THREADS=1)
    [(_, loss, _, correct, total)] = epochs(r.stdout)
    args = argparse.Namespace(dummy=True, data_dir=None)
    _, test_set = common.make_datasets(args)
    model = common.Net()
    model.load_state_dict(load(tmp_path / "c.pt")["model"])
    model.eval()
    with torch.no_grad():
        right = int((model(test_set.images).argmax(1) == test_set.labels).sum())
    assert (int(correct), int(total)) == (right, 10000)
    losses = read_records(rec, "loss")
    assert sorted({row["rank"] for row in losses}) == [0, 1, 2]
    mean = sum(row["loss"] * row["n"] for row in losses) / sum(row["n"] for row in losses)
    assert abs(float(loss) - mean) < 1e-4, (loss, mean)


def test_ddp_without_torchrun_says_how_to_start_it(tmp_path):
    r = run_script("lesson/ddp.py", check=False, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: start it with torchrun: torchrun --nproc-per-node 2 lesson/ddp.py"], r.stderr


def test_the_lesson_needs_common_alone():
    """...and of common.py the task alone (its datasets, model, loss and optimizer recipe): every
    collective the lesson runs, and its checkpoint's write, are in the lesson."""
    for name in ("one_process.py", "ddp.py"):
        text = (ROOT / "lesson" / name).read_text()
        imports = re.findall(r"^(?:import|from) (\w+)", text, re.M)
        assert set(imports) <= {"argparse", "os", "sys", "torch", "common"}, (name, imports)
        assert set(re.findall(r"common\.(\w+)", text)) <= {
            "add_task_flags", "prepare_data", "make_datasets", "collate", "make_model", "loss_fn",
            "make_optimizer", "make_scheduler"}, name
