"""The README's lesson: lesson/one_process.py, a plain training loop, and lesson/ddp.py, the
same loop made data-parallel under torchrun. Both train; the DDP version's processes each
take a disjoint shard, reshuffled every epoch, end with the same weights, count every test
sample once, and leave one checkpoint written by one process that a plain model loads. The
lesson needs torch, torchvision and the standard library: nothing of this repository."""
import importlib.util
import re

import pytest
import torch

from conftest import N_TEST, ROOT, TORCHRUN2, kept, load, read_records, run_script
from test_readme import changed_lines

LINE = re.compile(r"epoch (\d+) train_loss ([\d.]+) test_acc ([\d.]+) correct (\d+) total (\d+)$")


def lesson():
    """lesson/one_process.py as a module: its Net and its MNIST reader."""
    spec = importlib.util.spec_from_file_location("one_process", ROOT / "lesson" / "one_process.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def epochs(stdout):
    return [LINE.match(line).groups() for line in stdout.splitlines() if line.startswith("epoch")]


def test_one_process_trains_and_saves_a_plain_model(lesson_run):
    """conftest.lesson_run's run of lesson/one_process.py (2 epochs at batch 32)."""
    d = lesson_run("one_process")
    rows = epochs(kept(d, "run").stdout)
    assert [e for e, *_ in rows] == ["1", "2"], rows
    assert int(rows[-1][4]) == N_TEST and float(rows[-1][2]) > 80, rows  # learnable digits
    lesson().Net().load_state_dict(load(d / "c.pt")["model"])  # strict: plain keys


def test_ddp_shards_reshuffles_agrees_and_writes_once(lesson_run):
    """conftest.lesson_run's run of lesson/ddp.py: 2 processes under torchrun, 2 epochs at
    batch 32, recorded (tests/instrument)."""
    d = lesson_run("ddp")
    rec = d / "rec"
    rows = epochs(kept(d, "run").stdout)  # printed by rank 0 alone
    assert [e for e, *_ in rows] == ["1", "2"], rows
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
    saved = load(d / "c.pt")["model"]
    lesson().Net().load_state_dict(saved)  # the plain model's keys, no "module." prefix
    assert all(torch.equal(saved[k], finals[0][k]) for k in saved)  # the last weights


@pytest.mark.slow
def test_three_processes_report_the_whole_test_set_and_the_mean_loss(tiny_mnist, tmp_path):
    """3 processes on a test set that 3 does not divide (101 samples), 4 steps: the printed
    counts are the saved model's on the whole test set, evaluated here in one process, and the
    printed loss is the mean of every process's training losses, weighted by their samples
    (recorded as each process computed them)."""
    rec = tmp_path / "rec"
    rec.mkdir()
    r = run_script("lesson/ddp.py", "--data-dir", tiny_mnist, "--batch-size", 150, "--checkpoint",
                   tmp_path / "c.pt", launcher=(*TORCHRUN2[:-1], "--nproc-per-node=3"),
                   record=rec, timeout=300, OMP_NUM_THREADS=1)
    [(_, loss, _, correct, total)] = epochs(r.stdout)
    module = lesson()
    images, labels = module.mnist(tiny_mnist, train=False).tensors
    model = module.Net()
    model.load_state_dict(load(tmp_path / "c.pt")["model"])
    model.eval()
    with torch.no_grad():
        right = int((model(images).argmax(1) == labels).sum())
    assert (int(correct), int(total)) == (right, N_TEST) and N_TEST % 3, (correct, total)
    assert 0 < right < N_TEST  # 4 steps: an accuracy that every miscount would change
    losses = read_records(rec, "loss")
    assert sorted({row["rank"] for row in losses}) == [0, 1, 2]
    mean = sum(row["loss"] * row["n"] for row in losses) / sum(row["n"] for row in losses)
    assert abs(float(loss) - mean) < 1e-4, (loss, mean)


def test_ddp_without_torchrun_says_how_to_start_it(tmp_path):
    r = run_script("lesson/ddp.py", check=False, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: start it with torchrun: torchrun --nproc-per-node 2 lesson/ddp.py"], r.stderr


def test_the_lesson_imports_nothing_of_the_repository():
    """torch, torchvision and the standard library only: every collective the lesson runs, its
    model, data, loss and its checkpoint's write are in the lesson."""
    for name in ("one_process.py", "ddp.py", "fsdp.py"):
        text = (ROOT / "lesson" / name).read_text()
        imports = re.findall(r"^(?:import|from) (\w+)", text, re.M)
        assert set(imports) <= {"argparse", "math", "os", "sys", "torch", "torchvision"}, \
            (name, imports)
        assert "sys.path" not in text, name


@pytest.mark.slow
@pytest.mark.skipif(torch.__version__ < (2, 7), reason="FSDP2 on a CPU needs torch 2.7")
def test_fsdp_chapter_evaluates_evenly_and_ends_every_time(tiny_mnist, tmp_path):
    """lesson/fsdp.py, at most 160 lines and 60 changed from lesson/ddp.py, at 2 processes and
    --batch-size 100: rank 0 has 2 test batches (50 and 1 of the 101 samples), rank 1 one, and
    both run 2 forwards (each one a collective: otherwise rank 0 waits for its peer until the
    timeout). Rank 0 writes the whole model, which the plain Net loads strictly, and the
    printed counts are that model's on the whole test set, evaluated here in one process.
    Run 4 times in a row, each ending with exit 0: gloo's threads outlive FSDP's group, and
    one of them aborted Python's finalization in 1 run of 40 here (exit -6), so every process
    must end by os._exit, before it (recorded by tests/instrument: the cause, which a run
    shows every time, where the abort shows once in dozens). Why 30 s: 4 runs."""
    text = (ROOT / "lesson" / "fsdp.py").read_text()
    assert len(text.splitlines()) <= 160 and changed_lines("lesson/ddp.py", "lesson/fsdp.py") <= 60
    for run in range(4):
        (tmp_path / f"rec{run}").mkdir()
        r = run_script("lesson/fsdp.py", "--data-dir", tiny_mnist, "--batch-size", 100,
                       "--checkpoint", tmp_path / "c.pt", launcher=TORCHRUN2, timeout=120,
                       record=tmp_path / f"rec{run}", OMP_NUM_THREADS=1)
        ends = {e["rank"]: e for e in read_records(tmp_path / f"rec{run}", "exit")}
        assert sorted(ends) == [0, 1], ends
        assert all(e["then"] == "os._exit" and e["code"] == 0 for e in ends.values()), ends
    [(_, _, _, correct, total)] = epochs(r.stdout)
    module = lesson()
    images, labels = module.mnist(tiny_mnist, train=False).tensors
    model = module.Net()
    model.load_state_dict(load(tmp_path / "c.pt")["model"])  # strict: the plain model's keys
    with torch.no_grad():
        right = int((model.eval()(images).argmax(1) == labels).sum())
    assert (int(correct), int(total)) == (right, N_TEST) and 0 < right, r.stdout
