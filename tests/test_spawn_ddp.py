"""spawn_ddp.py end to end: real processes on gloo (CPU), tiny MNIST through torchvision."""
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch

from conftest import N_TEST, N_TRAIN, ROOT, busy_port, free_port, \
    load, read_metrics, read_records, run_script, script_env, session_processes

sys.path.insert(0, str(ROOT))
import common  # noqa: E402

SCRIPT = "spawn_ddp.py"
EPOCHS = 3


def tiny(data, *extra):
    """Flags for a quick run on the tiny data: 2 processes, global batch 64."""
    return ["--data-dir", data, "--nproc-per-node", 2, "--batch-size", 64, "--log-interval", 5,
            "--timeout", 30, *extra]


@pytest.fixture(scope="module")
def trained(tiny_mnist, tmp_path_factory):
    """One 3-epoch run with 2 processes, recorded; several tests read what it left."""
    d = tmp_path_factory.mktemp("trained")
    (d / "record").mkdir()
    (d / "ckpt").mkdir()
    result = run_script(SCRIPT, *tiny(tiny_mnist, "--epochs", EPOCHS, "--lr", 0.02,
                                      "--checkpoint", d / "ckpt" / "model.pt",
                                      "--metrics", d / "metrics.jsonl"), record=d / "record")
    return d, result


def test_loss_falls_and_accuracy_is_reported(trained):
    d, result = trained
    rows = read_metrics(d / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert all(r["world_size"] == 2 and r["total"] == N_TEST for r in rows)
    assert rows[-1]["train_loss"] < 0.5 * rows[0]["train_loss"]
    assert rows[-1]["test_acc"] > 80
    assert "loss" in result.stdout and "samples/s" in result.stdout  # progress lines


def test_one_checkpoint_written_by_one_process(trained):
    d, _ = trained
    assert sorted(p.name for p in (d / "ckpt").iterdir()) == ["model.pt"]  # no temp file left
    saves = [s for s in read_records(d / "record", "save") if "ckpt" in s["path"]]
    assert len(saves) == EPOCHS  # once per epoch, not once per process
    assert len({s["pid"] for s in saves}) == 1


def test_checkpoint_loads_safely_into_a_plain_model(trained):
    d, _ = trained
    ckpt = torch.load(d / "ckpt" / "model.pt", weights_only=True, map_location="cpu")
    assert ckpt["epoch"] == EPOCHS and ckpt["args"]["batch_size"] == 64
    assert not any(k.startswith("module.") for k in ckpt["model"])
    model = common.Net()
    model.load_state_dict(ckpt["model"])  # strict
    assert {"optimizer", "scheduler", "scaler"} <= ckpt.keys()


def test_replicas_are_identical_after_training(trained):
    d, _ = trained
    states = [load(d / "record" / f"final-rank{r}.pt") for r in (0, 1)]
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    saved = load(d / "ckpt" / "model.pt")["model"]
    for k in saved:  # and the checkpoint holds exactly that model
        assert torch.equal(saved[k], states[0][k]), k


def test_shards_cover_the_data_once_and_reshuffle(trained):
    d, _ = trained
    by_epoch = defaultdict(dict)
    for row in read_records(d / "record", "sampler"):
        by_epoch[row["epoch"]][row["rank"]] = row["indices"]
    assert sorted(by_epoch) == list(range(EPOCHS))
    for epoch, shards in by_epoch.items():
        assert sorted(shards) == [0, 1]
        assert len(shards[0]) == len(shards[1]) == N_TRAIN // 2
        assert sorted(shards[0] + shards[1]) == list(range(N_TRAIN))  # disjoint and complete
    assert by_epoch[0][0] != by_epoch[1][0] and by_epoch[1][0] != by_epoch[2][0]


@pytest.mark.slow
def test_module_prefixed_checkpoint_is_accepted(trained, tiny_mnist, tmp_path):
    d, _ = trained
    ckpt = load(d / "ckpt" / "model.pt")
    ckpt["model"] = {f"module.{k}": v for k, v in ckpt["model"].items()}  # as DDP/DP save it
    torch.save(ckpt, tmp_path / "prefixed.pt")
    run_script(SCRIPT, "--data-dir", tiny_mnist, "--nproc-per-node", 1, "--evaluate",
               "--checkpoint", tmp_path / "prefixed.pt", "--metrics", tmp_path / "m.jsonl")
    assert read_metrics(tmp_path / "m.jsonl")[0]["correct"] == \
        read_metrics(d / "metrics.jsonl")[-1]["correct"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["spawn_ddp.py", "dp_baseline.py"])
def test_the_schedule_waits_for_a_step_that_fp16_skipped(tiny_mnist, tmp_path, script):
    """fp16 autocast on the CPU with a GradScaler, and an infinite gradient forced on a loss of
    epoch 2 (tests/instrument): the scaler skips that optimizer step and halves its scale, and
    the script does not step the LR schedule either (pytorch/pytorch#44511): the scheduler
    counts exactly the optimizer's steps, however many it skipped. spawn_ddp.py stops after
    epoch 1 and resumes: the scale is saved (only fp16 has one; bf16:
    test_a_resume_keeps_the_precision_of_its_run) and continued."""
    ckpt, processes = tmp_path / "c.pt", ["--nproc-per-node", 2] * (script == "spawn_ddp.py")
    flags = ["--data-dir", tiny_mnist, *processes, "--batch-size", 64, "--amp", "fp16",
             "--epochs", 2, "--checkpoint", ckpt, "--metrics", tmp_path / "m.jsonl"]
    if script == "spawn_ddp.py":  # epoch 1, then epoch 2 in a resumed run
        run_script(script, *flags, "--stop-after", 1)
        assert load(ckpt)["scaler"]["scale"] == 2.0 ** 16  # nothing skipped yet
        flags.append("--resume")
    r = run_script(script, *flags, DDP_TEST_INF_GRAD_STEP=3 if "--resume" in flags else 13)
    assert r.stderr.count("test instrumentation: infinite gradient") >= 1, r.stderr
    ckpt = load(ckpt)
    steps = {int(s["step"]) for s in ckpt["optimizer"]["state"].values()}
    assert len(steps) == 1 and steps.pop() == ckpt["scheduler"]["last_epoch"] < 2 * 10
    assert ckpt["scaler"]["scale"] < 2.0 ** 16  # halved on each skip
    row = read_metrics(tmp_path / "m.jsonl")[-1]
    assert row["epoch"] == 2 and row["train_loss"] == row["train_loss"]  # not NaN


@pytest.mark.slow
def test_channels_last_trains_and_saves_a_plain_checkpoint(trained, tiny_mnist, tmp_path):
    """--channels-last, MNIST's default (the `trained` run): NHWC weights go through DDP's
    gradient buckets without a stride warning, are saved as they are, and the checkpoint
    evaluates the same in NCHW (--no-channels-last)."""
    d, result = trained
    assert "stride" not in result.stderr.lower()  # DDP warns when grads and buckets differ
    w = load(d / "ckpt" / "model.pt")["model"]["features.4.weight"]  # the 16-channel conv
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    last = read_metrics(d / "metrics.jsonl")[-1]
    run_script(SCRIPT, "--data-dir", tiny_mnist, "--nproc-per-node", 1, "--evaluate",
               "--no-channels-last", "--checkpoint", d / "ckpt" / "model.pt", "--metrics",
               tmp_path / "eval.jsonl")
    assert read_metrics(tmp_path / "eval.jsonl")[0]["correct"] == last["correct"]


@pytest.mark.slow
def test_two_nodes_on_one_machine(tiny_mnist, tmp_path):
    """Two launchers, one per "node", each starting one process, meet through node 0."""
    port = free_port()  # node 0 binds it
    common_args = [SCRIPT, "--data-dir", tiny_mnist, "--nnodes", 2, "--nproc-per-node", 1,
                   "--master-addr", "127.0.0.1", "--master-port", port, "--batch-size", 64,
                   "--timeout", 30]
    procs = [subprocess.Popen([sys.executable, *map(str, common_args), "--node-rank", str(n),
                               "--checkpoint", tmp_path / f"node{n}" / "c.pt",
                               "--metrics", tmp_path / f"m{n}.jsonl"],
                              cwd=ROOT, env=script_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for n in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    [row] = read_metrics(tmp_path / "m0.jsonl")
    assert row["world_size"] == 2 and row["total"] == N_TEST
    assert not (tmp_path / "m1.jsonl").exists()  # only global rank 0 reports
    assert (tmp_path / "node0" / "c.pt").exists() and not (tmp_path / "node1").exists()


@pytest.mark.slow
def test_missing_peer_fails_within_the_join_timeout(tiny_mnist):
    """A node that never arrives: node 0 gives up after --join-timeout, not after --timeout
    (which only bounds the collectives of a group that has formed)."""
    port = free_port()
    start = time.monotonic()
    r = run_script(SCRIPT, "--data-dir", tiny_mnist, "--nnodes", 2, "--node-rank", 0,
                   "--nproc-per-node", 1, "--master-addr", "127.0.0.1", "--master-port", port,
                   "--join-timeout", 5, check=False, timeout=60)
    assert r.returncode == 1
    assert time.monotonic() - start < 50  # 5 s, plus the start of two Pythons under load
    assert "[rank 0] error: distributed: " in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_nodes_with_different_process_counts_are_refused(tiny_mnist):
    """Global ranks are node_rank * nproc + local_rank: with 2 processes on node 0 and 1 on
    node 1 they would collide. Every node says so in one line before the group forms."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / SCRIPT), "--data-dir", str(tiny_mnist),
                               "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", str(2 - n),
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--batch-size", "60"],
                              cwd=ROOT, env=script_env(), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for n in (0, 1)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode != 0, out + err
        errors = [ln for ln in err.splitlines() if "error:" in ln]
        assert errors and "every node must run the same --nproc-per-node" in errors[0], err
        assert "Traceback" not in err and "step" not in out


@pytest.mark.slow
def test_ctrl_c_stops_every_process_cleanly(tmp_path):
    args = [SCRIPT, "--dummy", "--epochs", 50, "--log-interval", 1, "--checkpoint", tmp_path / "c.pt"]
    # A terminal's Ctrl-C reaches a program that has SIGINT's default action. A test run
    # started in the background (`pytest &` from a script) ignores SIGINT, and a program it
    # starts would inherit that: Python then installs no KeyboardInterrupt, and the run goes on.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets it to default
    try:
        proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=script_env(),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for line in proc.stdout:  # wait until training is under way
            if "step" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert not session_processes(proc.pid)  # no orphaned workers


# ---- bad input: one line, non-zero exit, within seconds ------------------------------------

def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def bad(*args, **kw):
    return run_script(SCRIPT, *args, check=False, timeout=60, **kw)


def test_error_missing_mnist(tmp_path):
    r = bad("--data-dir", tmp_path / "empty")
    assert_one_line_error(r, str(tmp_path / "empty"), "train-images-idx3-ubyte",
                          "t10k-labels-idx1-ubyte", "--dummy")


@pytest.mark.slow
def test_error_batch_not_divisible(tiny_mnist):
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--nproc-per-node", 3,
                              "--batch-size", 64), "--batch-size 64", "world size 3")


@pytest.mark.slow
def test_error_sync_bn_on_cpu(tiny_mnist):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where --sync-bn is valid")
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--sync-bn"), "--sync-bn", "CUDA")


@pytest.mark.cuda
def test_error_more_processes_than_gpus(tiny_mnist):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU machine")
    n = torch.cuda.device_count() + 1
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--nproc-per-node", n, gpus=True), "GPU")


def test_error_port_in_use(tiny_mnist):
    with busy_port() as s:
        port = s.getsockname()[1]
        assert_one_line_error(bad("--data-dir", tiny_mnist, "--master-port", port),
                              f"port {port}", "in use")


@pytest.mark.slow
def test_error_corrupt_checkpoint(tiny_mnist, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--checkpoint", garbage, "--resume"),
                          str(garbage), "corrupt")


@pytest.mark.slow
def test_error_truncated_checkpoint(trained, tiny_mnist, tmp_path):
    d, _ = trained
    data = (d / "ckpt" / "model.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--checkpoint", cut, "--evaluate"),
                          str(cut), "corrupt or truncated")


@pytest.mark.slow
def test_error_checkpoint_of_another_model(tiny_mnist, tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"model": torch.nn.Linear(784, 10).state_dict(), "epoch": 1}, other)
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--checkpoint", other, "--evaluate"),
                          str(other), "does not fit this model")


@pytest.mark.slow
def test_error_resume_without_checkpoint_file(tiny_mnist, tmp_path):
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--checkpoint", tmp_path / "none.pt",
                              "--resume"), "no checkpoint")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MNIST_DIR"), reason="set MNIST_DIR to the real MNIST")
def test_defaults_reach_99_percent_on_real_mnist(tmp_path):
    run_script(SCRIPT, "--data-dir", os.environ["MNIST_DIR"], "--metrics", tmp_path / "m.jsonl",
               timeout=300)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert rows[-1]["total"] == 10000
    assert rows[-1]["test_acc"] >= 99.0, rows
