"""torchrun_ddp.py end to end: real torchrun agents and workers on gloo (CPU)."""
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import N_TEST, ROOT, TRAIN, assert_no_deprecation_warnings, \
    assert_same_training_state, free_port, load, process_group, read_metrics, run_mains, \
    run_script, script_env, together, wait_for, workers_of

SCRIPT = "torchrun_ddp.py"
TORCHRUN = ("-m", "torch.distributed.run")  # the `torchrun` command, from this interpreter
LEGACY = ("-m", "torch.distributed.launch")


def standalone(nproc, *extra):
    return (*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra)


def assert_same_final_replicas(rec_a, rec_b, world_size):
    """Every rank of two runs ended with bit-identical parameters and buffers."""
    for r in range(world_size):
        a, b = (load(Path(d) / f"final-rank{r}.pt") for d in (rec_a, rec_b))
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)


# ---------------------------------------------------------------------------------------------
# Launchers

@pytest.mark.slow
@pytest.mark.parametrize("how", ["legacy launch module", "plain python"])
def test_other_ways_to_start(tiny_mnist, tmp_path, straight, how):
    """The legacy launcher passes --local-rank (and sets LOCAL_RANK); plain python has neither.
    Both train exactly what torchrun trains at the same world size (conftest.straight; one
    process: dp_baseline.py's, every core to it)."""
    (tmp_path / "rec").mkdir()
    args = ["--data-dir", tiny_mnist, *TRAIN, "--checkpoint", tmp_path / "c.pt"]
    if how.startswith("legacy"):  # the launcher itself warns that it is deprecated: expected
        r = run_script(SCRIPT, *args, launcher=(*LEGACY, "--nproc-per-node=2"),
                       record=tmp_path / "rec", allow="torch.distributed.launch is deprecated")
        assert "2 processes" in r.stdout
        assert_same_final_replicas(straight(2) / "rec", tmp_path / "rec", 2)
    else:
        r = run_script(SCRIPT, *args)
        assert "1 processes" in r.stdout
    ref = straight(2 if how.startswith("legacy") else 1)
    assert_same_training_state(load(ref / "c.pt"), load(tmp_path / "c.pt"))


@pytest.mark.slow
def test_pytorchjob_pods_with_rank_and_world_size_only_train_as_torchrun(tiny_mnist, straight,
                                                                          tmp_path):
    """A Kubeflow PyTorchJob in its plain form runs `python torchrun_ddp.py` in each pod with
    MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK only (no LOCAL_RANK, no GROUP_RANK): each pod
    is a node of one process. Two such pods train what torchrun's 2 processes train, bit for
    bit, to one checkpoint (each died of a KeyError on LOCAL_RANK at 73aa1d9)."""
    out = tmp_path / "run"
    pods = together([[sys.executable, ROOT / SCRIPT, "--data-dir", tiny_mnist, *TRAIN,
                      "--checkpoint", out / "c.pt", "--metrics", out / "m.jsonl"]] * 2,
                    cwd=lambda n: tmp_path, env=lambda rank: {"RANK": rank},
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=2,
                    OMP_NUM_THREADS=1)
    assert [p.returncode for p in pods] == [0, 0], pods
    assert "2 processes (2 node(s) x 1)" in pods[0].stdout, pods[0]
    assert_same_training_state(load(straight(2) / "c.pt"), load(out / "c.pt"))
    assert [row["world_size"] for row in read_metrics(out / "m.jsonl")] == [2, 2]


@pytest.mark.slow
def test_nodes_of_different_restart_counts_meet_in_the_agents_store(tiny_mnist, tmp_path):
    """Two nodes of one process whose agents count restarts differently (a survivor at 1, its
    replacement at 0) and host their store (TORCHELASTIC_USE_AGENT_STORE, as torchrun's static
    rendezvous does; here this test hosts it). torch 2.4's env:// put each node under a prefix
    of its count, where they never met (launch.torchrun_store takes it off; 2.15 has none).
    CI's oldest-torch run includes this test."""
    import torch.distributed as dist
    from datetime import timedelta
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    env = script_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, LOCAL_RANK=0,
                     LOCAL_WORLD_SIZE=1, TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS=1)
    cmd = [sys.executable, str(ROOT / SCRIPT), "--data-dir", str(tiny_mnist), "--batch-size",
           "64", "--join-timeout", "30", "--metrics", str(tmp_path / "m.jsonl")]
    with process_group(cmd, {**env, "RANK": "0", "GROUP_RANK": "0",
                             "TORCHELASTIC_RESTART_COUNT": "1"}, tmp_path) as node0:
        with process_group(cmd, {**env, "RANK": "1", "GROUP_RANK": "1",
                                 "TORCHELASTIC_RESTART_COUNT": "0"}, tmp_path) as node1:
            outs = [p.communicate(timeout=120) for p in (node0, node1)]
    del agent
    assert [node0.returncode, node1.returncode] == [0, 0], outs
    assert [row["world_size"] for row in read_metrics(tmp_path / "m.jsonl")] == [2]


def test_old_local_rank_spelling_is_accepted():
    """Launchers before torch 2.0 pass `--local_rank=N` (the legacy test covers `--local-rank`).
    The script's real main(), stopped where training would start (tests/run_mains.py)."""
    [r, bad] = run_mains(SCRIPT, [{"argv": ["--dummy", "--local_rank=0"], "env": {}},
                                  {"argv": ["--dummy", "--local_rank=x"], "env": {}}])
    assert r["started"] and not r["stderr"].strip(), r
    assert bad["code"] == 2 and "--local-rank/--local_rank" in bad["stderr"], bad


# ---------------------------------------------------------------------------------------------
# Elastic: snapshots, automatic resume, surviving a killed worker

KILL_ARGS = ("--batch-size", 32, "--epochs", 2, "--save-every", 6, "--log-interval", 100,
             "--timeout", 30)  # 19 steps per epoch; snapshots at steps 6, 12, 18 and epoch ends


@pytest.mark.slow
def test_killed_worker_restarts_and_ends_bit_identical(tiny_mnist, tmp_path, straight):
    """SIGKILL of rank 1 mid-epoch, once the first snapshot is there; then, in the group torchrun
    restarted, SIGKILL of rank 0 while it writes a snapshot (a slow disk, simulated: each write
    takes 0.5 s more). Each time torchrun restarts the group and the script resumes from the
    last whole snapshot by itself, and the half-written one is not it; the final weights equal
    a run that was never interrupted. Why 30 s: three starts of the group."""
    snap = tmp_path / "snap.pt"
    (tmp_path / "rec").mkdir()
    env = script_env(record=tmp_path / "rec", DDP_TEST_STEP_DELAY=0.05, DDP_TEST_SLOW_SAVE=0.5)
    cmd = [sys.executable, *standalone(2, "--max-restarts=2"), str(ROOT / SCRIPT),
           "--data-dir", str(tiny_mnist), *map(str, KILL_ARGS), "--checkpoint", str(snap)]
    with process_group(cmd, env) as proc:
        wait_for(snap.exists, 90, "the first snapshot")
        first = workers_of(proc.pid)
        os.kill(first[1], signal.SIGKILL)

        def writing():  # the restarted rank 0's own temporary file (checkpoint.save)
            now = workers_of(proc.pid)
            if len(now) == 2 and now[0] != first[0]:
                return [f for f in tmp_path.glob(f"snap.pt.{now[0]}-*.tmp")]
        wait_for(writing, 90, "a snapshot written by the restarted group")
        [tmp_file], before = writing(), load(snap)
        os.kill(workers_of(proc.pid)[0], signal.SIGKILL)
        after = load(snap)  # the previous snapshot, whole
        assert (after["epoch"], after["step"]) == (before["epoch"], before["step"])
        assert tmp_file.exists()  # killed mid-write, not after
        with pytest.raises(Exception):  # the one being written was cut off: half a file
            load(tmp_file)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert_no_deprecation_warnings(out + err)
    assert "restart 1 (TORCHELASTIC_RESTART_COUNT)" in out
    assert "restart 2 (TORCHELASTIC_RESTART_COUNT)" in out
    resumed = [ln for ln in out.splitlines() if ln.startswith(f"loaded {snap}")]
    assert len(resumed) == 2 and all("+ 0 step(s)" not in ln for ln in resumed), out  # mid-epoch
    uninterrupted = straight(2)  # KILL_ARGS's training, never interrupted
    assert_same_training_state(load(uninterrupted / "c.pt"), load(snap))
    assert_same_final_replicas(uninterrupted / "rec", tmp_path / "rec", 2)


@pytest.mark.slow
def test_finished_run_resumes_to_nothing(tiny_mnist, tmp_path, straight):
    """The command of a run that finished (conftest.straight's, on a copy), run again, loads the
    snapshot and trains no more: no metrics row, the same checkpoint."""
    ref = straight(2)
    for name in ("c.pt", "m.jsonl"):
        shutil.copy(ref / name, tmp_path / name)
    before = (tmp_path / "c.pt").read_bytes()
    r = run_script(SCRIPT, "--data-dir", tiny_mnist, *TRAIN, "--checkpoint", tmp_path / "c.pt",
                   "--metrics", tmp_path / "m.jsonl", launcher=standalone(2))
    assert "loaded" in r.stdout and "2 epoch(s) + 0 step(s)" in r.stdout
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2
    assert (tmp_path / "c.pt").read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Several nodes

def start_nodes(tmp_path, tiny_mnist, script_args, nodes=2, started=None, host="127.0.0.1",
                netns=None, agent_args=()):
    """One torchrun agent per "node" (only `started` of them, if given), each in its own
    directory (a disk of its own), meeting through the c10d rendezvous on `host`."""
    port, job = free_port(), uuid.uuid4().hex[:8]
    cmds = []
    for n in range(nodes if started is None else started):
        (tmp_path / f"node{n}").mkdir()
        prefix, extra = [], []
        if netns:  # run inside the namespace, gloo on its veth end, this node's own address
            prefix = ["ip", "netns", "exec", netns[n]["ns"]]
            extra = [f"--local-addr={netns[n]['addr']}", f"--rdzv-conf=is_host={int(n == 0)}"]
        cmds.append([*prefix, sys.executable, *TORCHRUN, f"--nnodes={nodes}", "--nproc-per-node=1",
                     "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={job}",
                     *extra, *agent_args, ROOT / SCRIPT, "--data-dir", tiny_mnist, *script_args])
    rs = together(cmds, cwd=lambda n: tmp_path / f"node{n}", timeout=150, env=lambda n: {
        "GLOO_SOCKET_IFNAME": netns[n]["dev"]} if netns else {})
    outs = [r.stdout + r.stderr for r in rs]
    for out in outs:
        assert_no_deprecation_warnings(out)
    return [r.returncode for r in rs], outs


NODE_ARGS = ("--batch-size", 64, "--epochs", 2, "--timeout", 30, "--checkpoint", "ckpt/c.pt",
             "--metrics", "m.jsonl")


def check_two_node_run(tmp_path, rcs, outs, each_node):
    assert rcs == [0, 0], "\n".join(outs)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    reporters = [d for d in nodes if (d / "m.jsonl").exists()]
    assert len(reporters) == 1  # global rank 0 alone reports, on whichever node it landed
    rows = read_metrics(reporters[0] / "m.jsonl")
    assert [r["world_size"] for r in rows] == [2, 2] and rows[-1]["total"] == N_TEST
    saved = [d / "ckpt" / "c.pt" for d in nodes if (d / "ckpt" / "c.pt").exists()]
    if not each_node:
        assert saved == [reporters[0] / "ckpt" / "c.pt"]  # exactly one writer in the job
    else:
        assert len(saved) == 2  # one copy per node, and the copies are the same model
        assert_same_training_state(load(saved[0]), load(saved[1]))


@pytest.mark.slow
def test_two_nodes_through_c10d_on_loopback(tiny_mnist, tmp_path):
    """Two agents meet through the c10d rendezvous; one process in the job writes the checkpoint.
    (A copy per node: test_two_nodes_in_network_namespaces, test_resume_together.py.)"""
    rcs, outs = start_nodes(tmp_path, tiny_mnist, NODE_ARGS)
    check_two_node_run(tmp_path, rcs, outs, each_node=False)


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair: two hosts with their own addresses."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    ns = [{"ns": f"ddp{tag}{n}", "dev": f"vddp{tag}{n}", "addr": f"10.213.0.{n + 1}"}
          for n in (0, 1)]

    def ip(*args):
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    made = []
    try:
        for n in ns:
            r = ip("netns", "add", n["ns"])
            if r.returncode != 0:
                pytest.skip(f"network namespaces not permitted here: {r.stderr.strip()}")
            made.append(n["ns"])
        steps = [("link", "add", ns[0]["dev"], "type", "veth", "peer", "name", ns[1]["dev"])]
        for n in ns:
            steps += [("link", "set", n["dev"], "netns", n["ns"]),
                      ("-n", n["ns"], "addr", "add", f"{n['addr']}/24", "dev", n["dev"]),
                      ("-n", n["ns"], "link", "set", n["dev"], "up"),
                      ("-n", n["ns"], "link", "set", "lo", "up")]
        for step in steps:
            r = ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot set up a veth pair here: ip {' '.join(step)}: {r.stderr.strip()}")
        yield ns
    finally:
        for name in made:
            ip("netns", "del", name)  # deletes the veth ends inside it too


@pytest.mark.slow
def test_two_nodes_in_network_namespaces(tiny_mnist, tmp_path, two_namespaces):
    """Closer to two real hosts: each node has its own network stack and address, and, with
    --save-on-each-node, writes its own copy of the checkpoint, the same model."""
    rcs, outs = start_nodes(tmp_path, tiny_mnist, [*NODE_ARGS, "--save-on-each-node"],
                            host=two_namespaces[0]["addr"], netns=two_namespaces)
    check_two_node_run(tmp_path, rcs, outs, each_node=True)


@pytest.mark.slow
def test_lone_node_fails_within_the_rendezvous_timeout(tiny_mnist, tmp_path):
    start = time.monotonic()
    rcs, outs = start_nodes(tmp_path, tiny_mnist, NODE_ARGS, nodes=2, started=1,
                            agent_args=["--rdzv-conf=join_timeout=5"])
    assert rcs[0] != 0
    assert time.monotonic() - start < 60
    assert "RendezvousTimeoutError" in outs[0]
