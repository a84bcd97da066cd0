"""Each script trains, resumes and evaluates, on gloo: the quick proof that a launch style works,
and what CI's second environment runs with the oldest torch supported (.ci/run).

Eight launches prove it, by agreeing with each other bit for bit: the same seed and global
batch train the same model in every launch style (DDP at world size 1 is the bare loop, and
the native path of apex_ddp.py at O0 is torchrun_ddp.py's), a run stopped after epoch 1 and
resumed ends where a straight run ends, and evaluation counts the same test samples correct at
1, 2 and 3 processes. The lesson pair (lesson/) trains too, and torchrun_fsdp.py trains
DDP's model where torch has FSDP2 on a CPU, and says which torch it needs where not."""
import pytest
import torch

from conftest import N_TEST, assert_same_training_state, load, read_metrics, run_script

TORCHRUN = ("-m", "torch.distributed.run", "--standalone")
FLAGS = ("--batch-size", 64, "--epochs", 2, "--log-interval", 5, "--timeout", 60)


def run(script, data, tmp, *extra, nproc=1, **kw):
    if script == "dp_baseline.py":
        return run_script(script, "--data-dir", data, *FLAGS[:-2], *extra, **kw)
    if script == "spawn_ddp.py":
        return run_script(script, "--data-dir", data, *FLAGS, "--nproc-per-node", nproc, *extra, **kw)
    return run_script(script, "--data-dir", data, *FLAGS, *extra, block="apex",
                      launcher=(*TORCHRUN, f"--nproc-per-node={nproc}"), **kw)


@pytest.fixture
def one_process(straight):
    """dp_baseline.py, 2 epochs straight: the reference at world size 1 (conftest)."""
    return straight(1, 64, 2)


@pytest.fixture
def two_processes(straight):
    """torchrun_ddp.py, 2 processes, 2 epochs straight: the reference at world size 2."""
    return straight(2, 64, 2)


def test_dp_baseline_trains(one_process):
    rows = read_metrics(one_process / "m.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["total"] == N_TEST
    assert rows[1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["test_acc"] > 80


def test_spawn_resumes_to_the_one_process_run(tiny_mnist, tmp_path, one_process):
    """DDP at world size 1, stopped after epoch 1 and resumed: the bare loop's model, bit for
    bit (the same training, only the launch differs)."""
    run("spawn_ddp.py", tiny_mnist, tmp_path, "--stop-after", 1, "--checkpoint", tmp_path / "c.pt")
    assert load(tmp_path / "c.pt")["epoch"] == 1
    r = run("spawn_ddp.py", tiny_mnist, tmp_path, "--resume", "--checkpoint", tmp_path / "c.pt")
    assert "loaded" in r.stdout and "1 epoch(s) + 0 step(s)" in r.stdout
    assert_same_training_state(load(one_process / "c.pt"), load(tmp_path / "c.pt"))


def test_apex_native_resumes_by_itself_to_the_torchrun_run(tiny_mnist, tmp_path, two_processes):
    """apex_ddp.py without apex, at O0: torchrun_ddp.py's loop. Stopped after epoch 1, the same
    command continues by itself (elastic), and ends with torchrun_ddp.py's model."""
    ckpt = tmp_path / "c.pt"
    run("apex_ddp.py", tiny_mnist, tmp_path, "--opt-level", "O0", "--stop-after", 1,
        "--checkpoint", ckpt, nproc=2)
    r = run("apex_ddp.py", tiny_mnist, tmp_path, "--opt-level", "O0", "--checkpoint", ckpt, nproc=2)
    assert "1 epoch(s) + 0 step(s)" in r.stdout
    assert_same_training_state(load(two_processes / "c.pt"), load(ckpt))


@pytest.mark.parametrize("script,nproc", [("spawn_ddp.py", 3), ("dp_baseline.py", 1)])
def test_evaluation_counts_the_same_at_any_world_size(tiny_mnist, tmp_path, two_processes,
                                                      script, nproc):
    """The 2-process run's checkpoint evaluated by 3 processes and by 1: the same count as the
    2-process run's own last evaluation, every test sample once (101 divides by neither)."""
    run(script, tiny_mnist, tmp_path, "--evaluate", "--checkpoint", two_processes / "c.pt",
        "--metrics", tmp_path / "m.jsonl", nproc=nproc)
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["total"] == N_TEST and row["world_size"] == nproc
    assert row["correct"] == read_metrics(two_processes / "m.jsonl")[-1]["correct"]


@pytest.mark.parametrize("script,launcher", [("lesson/one_process.py", ()),
                                             ("lesson/ddp.py", (*TORCHRUN, "--nproc-per-node=2"))])
def test_the_lesson_trains(tiny_mnist, tmp_path, script, launcher):
    """The README's lesson pair, on the torch at hand (tests/test_lesson.py checks it closely)."""
    r = run_script(script, "--data-dir", tiny_mnist, "--batch-size", 64, "--checkpoint",
                   tmp_path / "c.pt", launcher=launcher, OMP_NUM_THREADS=1)
    assert f"total {N_TEST}" in r.stdout and load(tmp_path / "c.pt")["epoch"] == 1


def test_fsdp_trains_the_torchrun_model_or_names_the_torch_it_needs(tiny_mnist, tmp_path,
                                                                    two_processes):
    """torchrun_fsdp.py, from torch 2.7 (FSDP2 on a CPU): torchrun_ddp.py's model, bit for bit
    (tests/test_fsdp.py resumes it, at other world sizes too). On an older torch: one line that
    names the torch it needs, exit code 2."""
    snap = tmp_path / "snap"
    if torch.__version__ < (2, 7):
        r = run_script("torchrun_fsdp.py", "--data-dir", tiny_mnist, "--checkpoint", snap,
                       check=False)
        assert r.returncode == 2 and r.stderr.strip() == "error: torchrun_fsdp.py needs torch " \
            f"2.7 or later (FSDP2 on a CPU); this is torch {torch.__version__}", r.stderr
        return
    run("torchrun_fsdp.py", tiny_mnist, tmp_path, "--checkpoint", snap, nproc=2)
    assert_same_training_state(load(two_processes / "c.pt"), load(snap))
