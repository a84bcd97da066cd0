"""torchrun_fsdp.py end to end on gloo (CPU): it trains DDP's model, its checkpoint is a DCP
folder that torch's converter reads, and it resumes mid-epoch, at other world sizes and after a
killed worker."""
import json
import os
import re
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

import common
from conftest import ROOT, TASK_RUN, TASKS, assert_same_training_state, given, kept, load, \
    make_tiny_mnist, process_group, read_metrics, read_tensorboard, run_mains, run_script, \
    script_env, wait_for, workers_of

SCRIPT = "torchrun_fsdp.py"
TORCHRUN = ("-m", "torch.distributed.run", "--standalone")
NEW_ENOUGH = torch.__version__ >= (2, 7)
pytestmark = pytest.mark.skipif(not NEW_ENOUGH, reason="FSDP2 on a CPU needs torch 2.7 "
                                "(tests/test_smoke.py checks the older torch's one line)")


def run(data, *extra, nproc=2, script=SCRIPT, **kw):
    data = ("--data-dir", data) if data else ()  # (none for a task without MNIST's flags)
    return run_script(script, *data, "--log-interval", 5, "--timeout", 30, *extra, nproc=nproc,
                      OMP_NUM_THREADS=1, **kw)


@pytest.mark.slow
def test_bf16_and_accumulate_train_what_ddp_trains(tiny_mnist, tmp_path):
    """--amp bf16 (FSDP's MixedPrecisionPolicy, BatchNorm in fp32; DDP's autocast) with
    --accumulate 2 (set_requires_gradient_sync; no_sync): DDP's model and optimizer state, bit
    for bit at 2 processes on this CPU (bf16 emulated where it lacks bf16 instructions)."""
    flags = ("--batch-size", 32, "--amp", "bf16", "--accumulate", 2)
    run(tiny_mnist, *flags, "--checkpoint", tmp_path / "ddp.pt", script="torchrun_ddp.py")
    r = run(tiny_mnist, *flags, "--checkpoint", tmp_path / "snap")
    assert not [ln for ln in r.stderr.splitlines() if "--amp bf16 on this CPU" not in ln], r.stderr
    assert_same_training_state(load(tmp_path / "ddp.pt"), load(tmp_path / "snap"))


@pytest.mark.slow
def test_killed_worker_restarts_and_ends_as_the_uninterrupted_ddp_run(tiny_mnist, tmp_path,
                                                                      straight):
    """SIGKILL rank 0 while the processes write the second mid-epoch snapshot (a slow disk,
    simulated): the first stays the checkpoint, whole; torchrun restarts the group, the script
    resumes from it by itself, and ends with the model and optimizer state of an uninterrupted
    run of torchrun_ddp.py, bit for bit. The folder holds a shard file per process, each about
    half of the state, and torch's converter makes it a plain state dict that common.py's
    model loads. --checkpoint is given as a shell completes a link to a folder, "snap/": one
    checkpoint with "snap". --tensorboard: the killed run wrote steps past the snapshot, and
    TensorBoard reads each step once, in order, with the uninterrupted run's printed loss
    (purge_step).
    Why 30 s: two starts of the group, and a slow write."""
    snap, tb = tmp_path / "snap", tmp_path / "tb"

    def second():  # the folder of the second snapshot, begun: not the one the link points to
        first = snap.is_symlink() and os.readlink(snap)
        return first and [p for p in tmp_path.glob("snap.*") if p.name != first and any(
            p.iterdir())]
    cmd = [sys.executable, *TORCHRUN, "--nproc-per-node=2", "--max-restarts=1",
           str(ROOT / SCRIPT), "--data-dir", str(tiny_mnist), "--batch-size", "32", "--epochs",
           "2", "--save-every", "6", "--log-interval", "1", "--timeout", "30",
           "--checkpoint", f"{snap}/", "--tensorboard", str(tb)]  # as a shell completes it
    env = script_env(DDP_TEST_STEP_DELAY=0.05, DDP_TEST_SLOW_SAVE=0.02)  # each tensor DCP
    with process_group(cmd, env) as proc:  # writes takes 0.02 s more: a save, about 1 s
        wait_for(second, 90, "the second snapshot")
        first = os.readlink(snap)
        os.kill(workers_of(proc.pid)[0], signal.SIGKILL)
        [cut] = second()
        assert not (cut / ".metadata").exists()  # cut off, unfinished
        assert os.readlink(snap) == first and (snap / ".metadata").exists()
        assert json.loads((snap / "run.json").read_text())["step"] == 6  # the first, whole
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{out}\n{err}"
    resumed = [ln for ln in out.splitlines() if ln.startswith(f"loaded {snap}")]
    assert resumed and "0 epoch(s) + 6 step(s)" in resumed[0], out  # in the middle of an epoch
    fsdp = load(snap)  # as torch's converter makes it a file
    assert_same_training_state(load(straight(2) / "c.pt"), fsdp)  # fp32: the issue asks 1e-4
    common.Net().load_state_dict(fsdp["model"])  # strict
    shards = [p.stat().st_size for p in snap.glob("*.distcp")]  # one per process, each about
    assert len(shards) == 2 and max(shards) < 0.6 * sum(shards), shards  # half the state
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("snap")) == \
        ["snap", os.readlink(snap)]  # the unfinished folder and the older ones deleted
    runs = sorted((read_tensorboard(f)["step/train_loss"] for f in tb.iterdir()),
                  key=lambda c: c[0][0])  # each run's own file: the killed one's first
    assert [(c[0][0], c[-1][0] > 6) for c in runs] == [(1, True), (7, True)], runs
    loss = read_tensorboard(tb)["step/train_loss"]
    assert [s for s, _ in loss] == list(range(1, 39)), loss
    for m in re.finditer(r"^epoch (\d)/2 step (\d+)/19 loss (\S+)", kept(straight(2), "run").stdout,
                         re.M):  # its loss every 5 steps: the mean since the epoch's start,
        step = (int(m[1]) - 1) * 19 + int(m[2])  # or since the resume in the resumed epoch
        if step <= 6 or step > 19:
            assert loss[step - 1][1] == pytest.approx(float(m[3]), abs=1e-4), step


@pytest.fixture(scope="module")
def after_epoch_1(tiny_mnist, tmp_path_factory):
    """2 processes, --batch-size 48 (divides by 1, 2 and 3), stopped after epoch 1 of 2, saved
    three times (steps 5 and 10, the epoch's end)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    run(tiny_mnist, "--batch-size", 48, "--epochs", 2, "--stop-after", 1, "--checkpoint",
        tmp / "snap", "--tensorboard", tmp / "tb", "--save-every", 5)
    return tmp / "snap"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 3])
def test_a_run_continues_at_another_world_size(tiny_mnist, tmp_path, after_epoch_1, nproc):
    """DCP reshards: the run stopped after epoch 1 at 2 processes continues at 1 (plain
    python) and at 3, and trains epoch 2 only; its --tensorboard curves go on at the global
    step where they stopped (13 steps an epoch at any world size). After the run's three saves,
    the link was replaced by a copy of the folder it pointed to, which stays beside it, with
    two folders of an older release's names, DIR.0 and DIR.1: the copy resumes, three saves
    follow, and the link and its newest folder are left."""
    snap = tmp_path / "snap"
    shutil.copytree(after_epoch_1.parent, tmp_path, symlinks=True, dirs_exist_ok=True)
    target = tmp_path / os.readlink(snap)
    snap.unlink()
    for copy in ("snap", "snap.0", "snap.1"):
        shutil.copytree(target, tmp_path / copy)
    r = run(tiny_mnist, "--batch-size", 48, "--epochs", 2, "--checkpoint", snap, "--metrics",
            tmp_path / "m.jsonl", "--tensorboard", tmp_path / "tb", "--save-every", 5,
            nproc=nproc)
    assert f"loaded {snap}: 1 epoch(s) + 0 step(s)" in r.stdout
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert (row["epoch"], row["world_size"]) == (2, nproc)
    curves = read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in curves["step/train_loss"]] == [5, 10, 18, 23]  # every 5 steps
    assert curves["epoch/world_size"] == [(13, 2), (26, nproc)]
    assert curves["epoch/test_acc"][-1] == (26, pytest.approx(row["test_acc"], rel=1e-6))
    assert snap.is_symlink() and json.loads((snap / "run.json").read_text())["epoch"] == 2
    assert sorted(p.name for p in tmp_path.glob("snap*")) == ["snap", os.readlink(snap)]


@pytest.mark.slow
def test_evaluation_with_unequal_shards_ends_and_says_the_saved_model(tmp_path, after_epoch_1):
    """The folder evaluated on 1,001 test samples (--data-dir is not the run's: the same
    training set, a longer test set), 2 processes, --batch-size 500 (250 a batch each): rank 0
    has 501 samples, 3 batches, rank 1 has 2. Each forward of a sharded model is a collective,
    so both run 3; every sample is counted once, and the accuracy is the saved model's,
    computed here from torch's converted file."""
    data = make_tiny_mnist(tmp_path / "data", n_test=1001)
    run(data, "--batch-size", 500, "--checkpoint", after_epoch_1, "--evaluate", "--metrics",
        tmp_path / "m.jsonl", timeout=90)
    [row] = read_metrics(tmp_path / "m.jsonl")
    model = common.Net().eval()
    model.load_state_dict(load(after_epoch_1)["model"])
    test_set = common.make_datasets(SimpleNamespace(dummy=False, data_dir=str(data)))[1]
    with torch.no_grad():
        correct = int((model(test_set.images).argmax(1) == test_set.labels).sum())
    assert (row["total"], row["correct"]) == (1001, correct) and correct > 500, row


@pytest.mark.slow
def test_refusals_of_the_sharded_form(tiny_mnist, tmp_path, after_epoch_1):
    """One line, exit 2, before training: what cannot work with a DCP folder; a filesystem
    without links (its os.symlink failing as FAT's); a model whose whole copies, one per process
    on this machine (8: torchrun's variables), do not fit the memory available (4 GiB, as
    /proc/meminfo would say), measured on the meta device; every other case fits."""
    (tmp_path / "file.pt").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    task = tmp_path / "wider.py"
    task.write_text("import torch.nn as nn\nimport common\n\n\ndef make_model(args):\n"
                    "    net = common.Net()\n    net.head[3] = nn.Linear(128, 11)\n"
                    "    return net\n")
    changed = tmp_path / "changed"  # a run of --task wider.py, whose model has changed since
    shutil.copytree(after_epoch_1, changed)
    meta = json.loads((changed / "run.json").read_text())
    (changed / "run.json").write_text(json.dumps({**meta, "args": {**meta["args"],
                                                                   "task": str(task)}}))
    big = tmp_path / "big.py"  # 440 million weights more: 1.6 GiB in fp32
    big.write_text("import torch.nn as nn\nimport common\n\n\ndef make_model(args):\n"
                   "    return nn.Sequential(common.Net(), nn.Linear(10, 40_000_000))\n")
    eight = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8",
             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    base = ["--data-dir", str(tiny_mnist), "--batch-size", "48", "--epochs", "2"]
    memory = ("each of the 8 processes on this machine builds the whole model (1.6 GiB) in host "
              "memory before sharding it: 13.1 GiB, and 4.0 GiB is available; start fewer per "
              "machine (--nproc-per-node), or see docs/fsdp.md")
    cases = {
        "--checkpoint " + str(tmp_path / "new") + ": torchrun_fsdp.py's checkpoint is a link "
        "replaced by a rename, which its filesystem refuses (Operation not permitted); give a "
        "path on another one": ["--checkpoint", str(tmp_path / "new")],
        memory: ["--task", str(big)],
        "--save-on-each-node": ["--save-on-each-node", "--checkpoint", str(tmp_path / "s")],
        "is a file; give a folder path": ["--checkpoint", str(tmp_path / "file.pt")],
        f"{after_epoch_1} is the checkpoint of another run: --lr 0.01 in the checkpoint, 0.02 "
        "now": ["--lr", "0.02", "--checkpoint", str(after_epoch_1)],
        "does not fit this model: head.3.bias (10,) in the checkpoint, (11,) here":
            ["--task", str(task), "--checkpoint", str(changed)],
        "is not a checkpoint of torchrun_fsdp.py (run.json: No such file or directory)":
            ["--checkpoint", str(tmp_path / "empty")],
    }
    results = run_mains(SCRIPT, [{"argv": base + argv, "env": eight if said == memory else {}}
                                 for said, argv in cases.items()],
                        DDP_TEST_NO_SYMLINKS=1, DDP_TEST_MEM_AVAILABLE=4 * 2**30)
    for said, r in zip(cases, results):
        assert r["code"] == 2 and not r["started"], (said, r)
        [line] = r["stderr"].strip().splitlines()
        assert re.match(r"(\[rank 0\] )?error: ", line) and said in line, (said, line)
    assert not list(tmp_path.glob("new*")), list(tmp_path.iterdir())  # no probe left


@pytest.mark.slow
def test_full_disk_keeps_the_previous_snapshot(tiny_mnist, small_disk):
    """A tmpfs with room for one snapshot's folder (about 1.1 MB) but not two: the second save
    fails in both processes, each node says so in one line, and the first stays whole."""
    snap = small_disk / "snap"
    r = run(tiny_mnist, "--batch-size", 32, "--epochs", 2, "--save-every", 6, "--checkpoint",
            snap, check=False)
    assert r.returncode != 0
    [line] = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert "could not write the checkpoint" in line and "the previous one, if any, is intact" \
        in line, r.stderr
    # The OS's reason; or, where the disk filled inside torch's zip writer (whose OSError DCP
    # drops when it gathers the processes' errors), the space left: either, run to run.
    assert "No space left on device" in line or " MiB free on its disk" in line, line
    assert (load(snap)["epoch"], load(snap)["step"]) == (0, 6)


@pytest.mark.slow
def test_a_task_of_its_own_trains_as_under_ddp(task_run, tmp_path):
    """tasks/text.py (dict samples, a padding collate, a Transformer with dropout): FSDP2 over
    the default units trains what DDP trains (conftest.task_run's spawn_ddp.py run), bit for
    bit in fp32."""
    d = task_run("text")
    task, path = given(d, "text")
    run(None, "--task", task, *TASKS["text"], *TASK_RUN, "--checkpoint", tmp_path / "snap",
        pythonpath=path)
    assert_same_training_state(load(d / "c.pt"), load(tmp_path / "snap"))


RANK_SEEDED = """

def make_model(args):  # a seed of its own in each process: other initial weights in each
    torch.manual_seed(int(os.environ["RANK"]))
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1), nn.Flatten(0))
"""


@pytest.mark.slow
def test_processes_that_build_other_weights_are_refused(tmp_path):
    """FSDP sends no initial weights: a make_model seeded per process would train a patchwork
    to the end, exit 0. One all-gather of a checksum refuses it before any step, in one line
    that names the other process (exit 2; torchrun's 1)."""
    task = tmp_path / "seeded.py"
    task.write_text("import os\n" + (ROOT / "tasks" / "regression.py").read_text() + RANK_SEEDED)
    r = run(None, "--task", task, "--samples", 256, "--batch-size", 64, "--checkpoint",
            tmp_path / "snap", check=False, cwd=tmp_path)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 1 and len(errors) == 1 and "step" not in r.stdout, r.stderr
    assert errors[0] == ("[rank 0] error: make_model built other weights in rank(s) 1 than in "
                         "rank 0 (a seed or a file of its own per process?): FSDP sends none, so "
                         "every process must build the same (docs/fsdp.md)"), errors
    assert not (tmp_path / "snap").exists()
