"""The claims of docs/troubleshooting.md, each shown by real processes: the fault is caused by
the test instrumentation (DDP_TEST_STALL, DDP_TEST_SLOW_SAVE) or by the small programs in
tests/troubleshooting/, never by a flag of the scripts."""
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, TORCHRUN2, Watched, busy_port, load, read_metrics, read_records, \
    script_env, workers_of

pytestmark = pytest.mark.slow  # about 2 minutes on 2 cores: out of the quick loop

SNIPPETS = ROOT / "tests" / "troubleshooting"
# What a rank prints when its collective timed out on gloo: the collective's own timeout, or the
# pair it used being closed by another operation's timeout a moment earlier (which of the two
# comes first is a race between gloo's threads).
GLOO_TIMEOUT = r"Timed out waiting (\d+)ms for (send|recv) operation to complete|Application timeout caused pair closure"


def tiny(data, timeout):
    """2 processes, global batch 64: 10 steps of the tiny MNIST, a progress line every 5."""
    return ["--data-dir", data, "--batch-size", 64, "--log-interval", 5, "--timeout", timeout]


# ---- 1. a rank falls out of step: the others fail after --timeout, not never -----------------

@pytest.mark.slow
def test_stalled_rank_fails_the_job_within_the_step_timeout(tiny_mnist):
    """torchrun_ddp.py: rank 1 sleeps 10 s before its third optimizer step; rank 0 waits for it
    in the next step's collective and fails after --step-timeout 6, not --timeout (300 s here):
    past the first step, the group's timeout is the steady one. py-spy (where installed) shows
    where each rank is while it waits."""
    timeout, stall, dumps = 6, 10, {}

    def spy(agent_pid):
        for rank, pid in sorted(workers_of(agent_pid).items()):
            dumps[rank] = subprocess.run(["py-spy", "dump", "--pid", str(pid)], text=True,
                                         capture_output=True, timeout=30).stdout

    def on_line(run, line):
        if "sleeps" in line and shutil.which("py-spy"):
            time.sleep(1)  # rank 0 reaches its collective within milliseconds
            threading.Thread(target=spy, args=(run.pid,)).start()

    run = Watched([sys.executable, *TORCHRUN2, ROOT / "torchrun_ddp.py", *tiny(tiny_mnist, 300),
                   "--step-timeout", timeout],
                  script_env(DDP_TEST_STALL=f"1:3:{stall}"), timeout=150, on_line=on_line)
    t_stall, _ = run.first(r"test instrumentation: rank 1 sleeps")
    t_error, line = run.first(GLOO_TIMEOUT)
    assert line.startswith("[rank 0] error: distributed: "), line  # one line, no traceback
    m = re.search(r"Timed out waiting (\d+)ms", line)
    assert m is None or int(m.group(1)) == timeout * 1000
    assert timeout - 0.5 < t_error - t_stall < timeout + 20, run.text  # + slack for load
    assert run.returncode == 1  # torchrun's, after its ChildFailedError summary
    assert "ChildFailedError" in run.text
    assert run.seconds < t_stall + stall + 40  # rank 1 ends once its sleep is over
    if shutil.which("py-spy"):
        assert "_stall (instrument_torch.py" in dumps[1] and "train (torchrun_ddp.py" in dumps[1]
        assert "train (torchrun_ddp.py" in dumps[0] and "_stall" not in dumps[0], dumps[0]


@pytest.mark.slow
def test_slow_save_on_rank_0_fails_the_others_at_the_barrier(tiny_mnist, tmp_path):
    """spawn_ddp.py: rank 0's checkpoint write takes 6 s (a slow disk); rank 1 waits at the
    barrier after it and fails after --timeout 3. Rank 0 still completes the checkpoint."""
    timeout = 3
    run = Watched([sys.executable, ROOT / "spawn_ddp.py", *tiny(tiny_mnist, timeout),
                   "--checkpoint", tmp_path / "c.pt"],
                  script_env(DDP_TEST_SLOW_SAVE=6), timeout=150)
    t_last_step, _ = run.first(r"epoch 1/1 step 10/10")
    t_error, line = run.first(r"\[rank 1\] error: distributed: Timed out waiting 3000ms for recv")
    assert timeout - 0.5 < t_error - t_last_step < timeout + 20, run.text  # + slack for load
    assert run.returncode == 1 and "error: worker" not in run.text  # the launcher adds nothing
    assert "Traceback" not in run.text
    assert load(tmp_path / "c.pt")["epoch"] == 1  # written whole, after the SIGTERM
    assert not list(tmp_path.glob("*.tmp"))


def test_the_defaults_ride_out_a_slow_first_step_and_a_slow_save(tiny_mnist, tmp_path):
    """The other side: rank 1's first step and rank 0's checkpoint writes (at step 5 and at the
    end) each take 3.5 s, longer than --join-timeout and --step-timeout (2 s here), and the run
    ends normally with the default --timeout (600 s). The join timeout bounds the meeting, the
    step timeout the steps after the first; the first step (which may compile) and a
    checkpoint's writer get --timeout."""
    run = Watched([sys.executable, ROOT / "spawn_ddp.py", "--data-dir", tiny_mnist,
                   "--batch-size", 64, "--log-interval", 5, "--join-timeout", 2,
                   "--step-timeout", 2, "--save-every", 5,
                   "--checkpoint", tmp_path / "c.pt", "--metrics", tmp_path / "m.jsonl"],
                  script_env(DDP_TEST_SLOW_SAVE=3.5, DDP_TEST_STALL="1:1:3.5"), timeout=150)
    assert run.returncode == 0, run.text
    run.first(r"test instrumentation: rank 1 sleeps 3.5 s before step 1")
    assert [row["epoch"] for row in read_metrics(tmp_path / "m.jsonl")] == [1]


def test_a_skipped_collective_waits_for_the_timeout(tiny_mnist):
    """spawn_ddp.py: rank 1 skips the first reduce_tensor (as `if rank == 0:` around it would).
    Rank 0 waits in it for rank 1, which has gone on to DDP's gradient all-reduce; nothing pairs
    up, and the job fails after --timeout (5 s here). Usually rank 0 times out first; under
    load rank 1's wait can run out first, and rank 0 then fails on the connection rank 1
    closed as it exited (busy CI run M), or gloo closes the timed-out pair before its rank's
    line is out, and the other's "Connection closed" comes first (a busy run, 2026-11-29): a
    rank says the timeout either way."""
    run = Watched([sys.executable, ROOT / "spawn_ddp.py", *tiny(tiny_mnist, 5)],
                  script_env(DDP_TEST_SKIP_REDUCE="1:1"), timeout=120)
    t_skip, _ = run.first(r"test instrumentation: rank 1 skips reduce_tensor call 1")
    t_error, _ = run.first(r"\[rank [01]\] error: distributed: ")
    assert re.search(rf"\[rank [01]\] error: distributed: .*({GLOO_TIMEOUT})", run.text), run.text
    assert 4.5 < t_error - t_skip < 60, run.text
    _, line = run.first(r"\[rank 0\] error: distributed: ")
    assert re.search(rf"{GLOO_TIMEOUT}|Connection closed by peer", line), line
    assert run.returncode == 1 and "error: worker" not in run.text


def test_ddp_reads_the_wrong_object_under_detail_on_gloo(tmp_path):
    """The torch bug behind the scripts' refusal of DETAIL on gloo (test_bad_input): DDP's
    constructor reads the gloo group's thread count from DETAIL's wrapper as if it were the gloo
    group (c10d's Logger::set_env_variables). With INFO it logs the count and runs; with DETAIL
    what the read finds depends on memory: the process crashes (torch 2.15 here) or logs another
    number and goes on (torch 2.4.1: 0, or 1948280182). This fails once torch reads the count
    right: then the refusal can go."""
    def run(debug):
        r = Watched([sys.executable, SNIPPETS / "ddp_detail.py"],
                    script_env(TORCH_DISTRIBUTED_DEBUG=debug, TORCH_CPP_LOG_LEVEL="INFO"),
                    timeout=120, cwd=tmp_path)  # where a core dump (1.5 GB) may land
        return r, re.findall(r"^gloo_num_threads: (-?\d+)$", r.text, re.MULTILINE)

    info, count = run("INFO")
    assert info.returncode == 0 and len(count) == 1 and "DDP constructed" in info.text, info.text
    detail, logged = run("DETAIL")
    crashed = detail.returncode == -signal.SIGSEGV and not logged
    wrong = detail.returncode == 0 and len(logged) == 1 and logged != count
    assert crashed or wrong, f"exit code {detail.returncode}, logged {logged} (INFO: {count}):\n" \
                             f"{detail.text}"


@pytest.mark.parametrize("debug", ["DETAIL", "INFO", "OFF"])
def test_detail_names_the_mismatched_collective(debug):
    """Rank 0 alone runs an all-reduce (tests/troubleshooting/mismatch.py). With DETAIL both
    collectives are named at once; with INFO or without the variable, the ranks wait for the
    3-second timeout."""
    run = Watched([sys.executable, SNIPPETS / "mismatch.py", 3],
                  script_env(TORCH_DISTRIBUTED_DEBUG=debug), timeout=120)
    assert run.returncode == 1
    assert "finished" not in run.text
    if debug == "DETAIL":
        _, line = run.first(r"^RuntimeError: Detected mismatch between collectives on ranks\. ")
        # whichever rank reports it names its own collective first and the other's second
        found = re.findall(r"Rank (\d) is running collective: CollectiveFingerPrint\("
                           r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[(\d*)\]", line)
        assert sorted(found) == [("0", "1", "ALLREDUCE", "1"), ("1", "1", "BROADCAST", "4")], line
        assert "Timed out" not in run.text
    else:  # mp.spawn reports the rank that exits first: the one that timed out, or the other,
        # whose pair the first closed when it gave up (seen once in a busy run of the suite)
        run.first(rf"RuntimeError: .*({GLOO_TIMEOUT}|Connection closed by peer)")
        assert run.seconds > 3 and "Detected mismatch" not in run.text


def test_a_wrong_gloo_interface_fails_at_once(tiny_mnist):
    run = Watched([sys.executable, ROOT / "spawn_ddp.py", *tiny(tiny_mnist, 30)],
                  script_env(GLOO_SOCKET_IFNAME="nosuchif0"), timeout=120)
    # Both ranks fail at once; the first to exit makes the launcher stop the other, which may
    # not have said why yet: one line at least, each whole and naming the interface.
    errors = [ln for _, ln in run.lines if "error: distributed:" in ln]
    assert errors and all(ln.count("error:") == 1 and re.fullmatch(  # not two lines run together
        r"\[rank [01]\] error: distributed: .*Unable to find address for: nosuchif0", ln)
        for ln in errors), run.text
    assert run.returncode == 1
    assert "step" not in run.text


# ---- 3. a busy port (spawn_ddp.py: test_error_port_in_use in test_spawn_ddp.py) -------------

def test_torchrun_reports_a_busy_master_port(tiny_mnist):
    with busy_port() as s:
        port = s.getsockname()[1]
        run = Watched([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                       f"--master-port={port}", ROOT / "torchrun_ddp.py", *tiny(tiny_mnist, 30)],
                      script_env(), timeout=120)
    assert run.returncode == 1
    run.first(rf"DistNetworkError: The server socket has failed to listen on any local network "
              rf"address\. port: {port}, .*EADDRINUSE")


# ---- 2. parameters without a gradient ------------------------------------------------------

def test_info_names_the_parameters_without_a_gradient(tmp_path):
    """tests/troubleshooting/unused_parameters.py: the error of torch 2.14 at the second step,
    the parameter names under INFO, and the two ways out. The program starts its own gloo
    group (docs quote it): it imports torch.distributed.nn before the group exists, as
    common.py does, or its gloo threads outlive it (a CI run aborted with "terminate called
    without an active exception"): none is left when it returns (test_shutdown.py's check)."""
    run = Watched([sys.executable, SNIPPETS / "unused_parameters.py"],
                  script_env(record=tmp_path, TORCH_DISTRIBUTED_DEBUG="INFO",
                             TORCH_CPP_LOG_LEVEL="INFO"), timeout=120)
    assert run.returncode == 0, run.text
    run.first(r"\[Rank 0\]: DDP Initialized with: $")  # with TORCH_CPP_LOG_LEVEL=INFO
    run.first(r"^module_name: TwoHeads$")
    run.first(r"^--- DDP\(model\): step 1 failed: Expected to have finished reduction in the "
              r"prior iteration before starting a new one\.")
    run.first(r"^Parameters which did not receive grad for rank 0: unused\.bias, unused\.weight$")
    run.first(r"^Parameter indices which did not receive grad for rank 0: 4 5$")
    run.first(r"^--- DDP\(model, find_unused_parameters=True\): 3 steps done$")
    run.first(r"^--- DDP\(model, static_graph=True\): 3 steps done$")
    exits = read_records(tmp_path, "exit")
    assert sorted(e["rank"] for e in exits) == [0, 1]
    assert not [t for e in exits for t in e["threads"] if "gloo" in t], exits


# ---- 4. Jupyter ----------------------------------------------------------------------------

CELL = """
import torch.multiprocessing as mp

def worker(rank):
    print(f"worker {rank} runs", flush=True)

mp.spawn(worker, nprocs=2)
"""


def test_spawn_cannot_start_a_function_defined_in_main_without_a_file():
    """`python -c`, like a notebook, has a __main__ without a file: the spawned processes cannot
    find the function. The same worker imported from a module runs."""
    run = Watched([sys.executable, "-c", CELL], script_env(), timeout=120)
    assert run.returncode == 1
    run.first(r"^AttributeError: Can't get attribute 'worker' on <module '__main__' \(built-in\)>$")
    assert "runs" not in run.text
    fixed = CELL.replace('def worker(rank):\n    print(f"worker {rank} runs", flush=True)\n',
                         "from notebook_worker import worker\n")
    run = Watched([sys.executable, "-c", fixed], script_env(pythonpath=[SNIPPETS]), timeout=120)
    assert run.returncode == 0, run.text
    assert {"worker 0 runs", "worker 1 runs"} <= {line for _, line in run.lines}
    forked = CELL.replace("mp.spawn(worker, nprocs=2)",
                          'mp.start_processes(worker, nprocs=2, start_method="fork")')
    run = Watched([sys.executable, "-c", forked], script_env(), timeout=120)
    assert run.returncode == 0, run.text
    assert {"worker 0 runs", "worker 1 runs"} <= {line for _, line in run.lines}


# ---- 6. long work on one rank --------------------------------------------------------------

@pytest.mark.slow
def test_a_patient_group_waits_out_rank_0_but_monitored_barrier_does_not():
    """tests/troubleshooting/waiting_for_one_rank.py rank0: a barrier of a group with a 60 s
    timeout waits out 6 s of work on rank 0 while the main group's timeout is 3 s;
    monitored_barrier(timeout=20 s) does not: rank 1 waits for rank 0 with the group's 3 s."""
    run = Watched([sys.executable, SNIPPETS / "waiting_for_one_rank.py", "rank0"], script_env(),
                  timeout=120)
    assert run.returncode == 1
    for rank in (0, 1):
        run.first(rf"\] rank {rank}: passed the barrier of the group with the 60 s timeout$")
    run.first(r"\[ *[3-9]\.\ds\] rank 1: monitored_barrier failed: Rank 1 successfully reached "
              r"monitoredBarrier, but received errors while waiting for send/recv from rank 0\.")


def test_monitored_barrier_names_the_rank_that_did_not_arrive():
    """tests/troubleshooting/waiting_for_one_rank.py rank1: rank 1 works 6 s alone; rank 0's
    monitored_barrier(timeout=3 s) fails after 3 s naming rank 1."""
    run = Watched([sys.executable, SNIPPETS / "waiting_for_one_rank.py", "rank1"], script_env(),
                  timeout=120)
    assert run.returncode == 1
    run.first(r"\[ *[3-9]\.\ds\] rank 0: monitored_barrier failed: \[Rank 0\]: Rank 1 failed to pass "
              r"monitoredBarrier in 3000 ms$")
