"""spawn_ddp.py end to end: real processes on gloo (CPU), tiny MNIST through torchvision. (Its
shared run, stopped by SIGTERM and resumed, and what each process did in it: test_smoke.py.)"""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import N_TEST, ROOT, busy_port, correct_of, free_port, kept, load, read_metrics, \
    read_records, run_script, script_env, session_processes, spawn_nodes

sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from ddpkit import checkpoint  # noqa: E402

SCRIPT = "spawn_ddp.py"


def test_module_prefixed_checkpoint_is_accepted(preempted, tmp_path):
    """A checkpoint whose model keys carry DDP's or DataParallel's "module." prefix (as they save
    it) loads, as the scripts load it (checkpoint.load, load_model_state), into exactly the
    model of the same checkpoint without the prefix (the shared run's, conftest.preempted)."""
    plain = load(preempted(SCRIPT) / "c.pt")["model"]
    torch.save({"model": {f"module.{k}": v for k, v in plain.items()}}, tmp_path / "p.pt")
    model = common.Net()
    checkpoint.load_model_state(model, checkpoint.load(tmp_path / "p.pt")["model"], "p.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.items())


@pytest.mark.slow
def test_the_schedule_waits_for_a_step_that_fp16_skipped(tiny_mnist, tmp_path):
    """fp16 autocast on the CPU with a GradScaler, and an infinite gradient forced on the third
    loss of each run (tests/instrument): the scaler skips that optimizer step and halves its
    scale, and the script does not step the LR schedule either (pytorch/pytorch#44511): the
    scheduler counts exactly the optimizer's steps. dp_baseline.py trains epoch 1; spawn_ddp.py
    with 2 processes resumes its checkpoint for epoch 2 (the scripts share checkpoints, this way
    too: test_spawn_resumes_to_the_one_process_run), continuing from the saved scale (only fp16
    has one; bf16: test_a_resume_keeps_the_precision_of_its_run), and skips again."""
    ckpt, steps = tmp_path / "c.pt", 19  # an epoch
    flags = ["--data-dir", tiny_mnist, "--batch-size", 32, "--amp", "fp16", "--epochs", 2,
             "--checkpoint", ckpt, "--metrics", tmp_path / "m.jsonl"]
    for script, more in (("dp_baseline.py", ["--stop-after", 1]),
                         (SCRIPT, ["--nproc-per-node", 2, "--resume"])):
        r = run_script(script, *flags, *more, DDP_TEST_INF_GRAD_STEP=3)
        assert "test instrumentation: infinite gradient for training loss 3" in r.stderr
        state = load(ckpt)
        taken = {int(s["step"]) for s in state["optimizer"]["state"].values()}
        assert len(taken) == 1 and taken.pop() == state["scheduler"]["last_epoch"] < steps, state
        steps += 19
    assert load(ckpt)["scaler"]["scale"] == 2.0 ** 16 / 4  # halved in each run: continued
    row = read_metrics(tmp_path / "m.jsonl")[-1]
    assert (row["epoch"], row["world_size"]) == (2, 2) and row["train_loss"] == row["train_loss"]
    assert row["test_acc"] > 80


def test_channels_last_trains_and_saves_a_plain_checkpoint(preempted, tiny_mnist):
    """--channels-last, MNIST's default (the shared run, conftest.preempted): NHWC weights go
    through DDP's gradient buckets without a stride warning, are saved as they are, and the
    checkpoint evaluates the same in NCHW, computed here."""
    d = preempted(SCRIPT)
    assert "stride" not in (kept(d, "stopped").stderr + kept(d, "resumed").stderr).lower()
    state = load(d / "c.pt")["model"]
    w = state["features.4.weight"]  # the 16-channel conv
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    assert correct_of(state, tiny_mnist, layout=torch.contiguous_format) == \
        read_metrics(d / "m.jsonl")[-1]["correct"]


@pytest.mark.slow
def test_two_nodes_on_one_machine(tiny_mnist, tmp_path):
    """Two launchers, one per "node", each starting one process, meet through node 0's TCP
    store; the store init_process_group gets waits --timeout (77), not --join-timeout
    (test_init_process_group_gets_a_store_that_waits_the_timeout)."""
    rs = spawn_nodes(lambda n: ["--data-dir", tiny_mnist, "--nproc-per-node", 1, "--batch-size",
                                64, "--timeout", 77, "--checkpoint", tmp_path / f"node{n}" / "c.pt",
                                "--metrics", tmp_path / f"m{n}.jsonl"], record=tmp_path)
    assert [r.returncode for r in rs] == [0, 0], rs
    [row] = read_metrics(tmp_path / "m0.jsonl")
    assert row["world_size"] == 2 and row["total"] == N_TEST
    assert not (tmp_path / "m1.jsonl").exists()  # only global rank 0 reports
    assert (tmp_path / "node0" / "c.pt").exists() and not (tmp_path / "node1").exists()
    inits = read_records(tmp_path, "init")
    assert sorted(r["rank"] for r in inits) == [0, 1]
    assert {r["store_timeout"] for r in inits} == {77}, inits


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
    rs = spawn_nodes(lambda n: ["--data-dir", tiny_mnist, "--nproc-per-node", 2 - n,
                                "--batch-size", 60])
    for r in rs:
        assert r.returncode != 0, r
        errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        assert errors and "every node must run the same --nproc-per-node" in errors[0], r.stderr
        assert "Traceback" not in r.stderr and "step" not in r.stdout


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


def test_error_batch_not_divisible(tiny_mnist):
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--nproc-per-node", 3,
                              "--batch-size", 64), "--batch-size 64", "world size 3")


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


def test_error_corrupt_checkpoint(tiny_mnist, tmp_path):
    """(A truncated checkpoint, another model's, none at the path: rows of test_bad_input.py's
    table, in every script.)"""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    assert_one_line_error(bad("--data-dir", tiny_mnist, "--checkpoint", garbage, "--resume"),
                          str(garbage), "corrupt")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MNIST_DIR"), reason="set MNIST_DIR to the real MNIST")
def test_defaults_reach_99_percent_on_real_mnist(tmp_path):
    run_script(SCRIPT, "--data-dir", os.environ["MNIST_DIR"], "--metrics", tmp_path / "m.jsonl",
               timeout=300)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert rows[-1]["total"] == 10000
    assert rows[-1]["test_acc"] >= 99.0, rows
