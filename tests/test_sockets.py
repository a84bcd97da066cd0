"""What a job on one machine listens on: every listening TCP socket of the job's processes
(the launcher or torchrun's agent, the training processes, their data workers), read from
/proc while the job trains (a socket's inode in /proc/PID/fd, its address in /proc/net/tcp
and tcp6). torch.distributed's stores have no authentication (docs/security.md), so a job on
one machine should listen on loopback only, or not at all.

- spawn_ddp.py: a FileStore in a private folder, gloo on the loopback interface: loopback only;
- dp_baseline.py and `python torchrun_ddp.py`: one process, nothing on the network;
- torchrun --standalone: the workers listen on loopback, but torchrun's agent hosts its stores
  on every interface, whatever its flags (pytorch/pytorch#173909): recorded here, so that this
  test fails, and says so, the day torch changes it;
- torchrun with a file rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the agent listens
  on nothing, and rank 0's store on every interface (pytorch/pytorch#173909), recorded too."""
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT, family, read_metrics, script_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")]

TORCHRUN = ("-m", "torch.distributed.run")
ARGS = ("--batch-size", 64, "--epochs", 2, "--log-interval", 1)
LOOPBACK = ("127.", "::1")


def _address(hex_address):
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip, 16))), int(port, 16)
    words = b"".join(struct.pack("<I", int(ip[i:i + 8], 16)) for i in range(0, 32, 8))
    address = socket.inet_ntop(socket.AF_INET6, words)
    return address.removeprefix("::ffff:"), int(port, 16)


def listening_inodes():
    """{socket inode: (address, port)} of every TCP socket in state LISTEN (0A)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    found[int(fields[9])] = _address(fields[1])
    return found


def sockets_of(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # the process ended, or a descriptor closed meanwhile
        pass
    return inodes


def listening_while_it_runs(cmd, env_extra=(), cwd=ROOT):
    """Runs `cmd` to its end; {(role, address, port)} of every listening socket seen in the
    meantime, role "launcher" for a socket the process started held, "child" for one only its
    descendants held. By socket, not by process: a child between its fork and its exec still
    holds the launcher's descriptors (torchrun's agent starts its workers with Popen, which
    closes them in the child just before the exec; a busy CI run saw one there)."""
    env = script_env(DDP_TEST_STEP_DELAY=0.05, **dict(env_extra))
    proc = subprocess.Popen([sys.executable, *map(str, cmd)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address, launchers = {}, set()  # inode: (address, port); inodes the launcher held
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        table = listening_inodes()
        for pid in family(proc.pid):
            for inode in sockets_of(pid) & table.keys():
                address[inode] = table[inode]
                if pid == proc.pid:
                    launchers.add(inode)
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    out = proc.communicate()[0]
    assert proc.returncode == 0, out
    assert "epoch 2 train_loss" in out, out  # it trained while we looked
    return {("launcher" if inode in launchers else "child", *where)
            for inode, where in address.items()}


def not_loopback(seen):
    return {s for s in seen if not s[1].startswith(LOOPBACK)}


def test_spawn_on_one_machine_listens_on_loopback_only(tiny_mnist):
    seen = listening_while_it_runs(["spawn_ddp.py", "--data-dir", tiny_mnist, *ARGS])
    assert seen, "gloo's own sockets should have been seen"  # the lister works
    assert not not_loopback(seen), seen


@pytest.mark.parametrize("script", ["dp_baseline.py", "torchrun_ddp.py"])
def test_one_process_listens_on_nothing_reachable(tiny_mnist, tmp_path, script):
    """`python SCRIPT`, as a laptop user without torchrun runs it, and here without Linux's
    APIs as on macOS or Windows (DDP_TEST_NOT_LINUX, test_portability.py): it trains, and
    listens on nothing another machine reaches."""
    seen = listening_while_it_runs([script, "--data-dir", tiny_mnist, *ARGS, "--metrics",
                                    tmp_path / "m.jsonl"], {"DDP_TEST_NOT_LINUX": 1})
    assert not not_loopback(seen), seen
    row = read_metrics(tmp_path / "m.jsonl")[-1]
    assert row["world_size"] == 1 and row["train_loss"] < 2.3


def test_torchrun_standalone_agent_listens_on_every_interface_today(tiny_mnist):
    """The workers' sockets are on loopback; the agent's two stores (rendezvous, and the one it
    shares with the workers) are on every interface. If this fails, torch has changed: update
    docs/security.md."""
    seen = listening_while_it_runs([*TORCHRUN, "--standalone", "--nproc-per-node=2",
                                    "torchrun_ddp.py", "--data-dir", tiny_mnist, *ARGS])
    exposed = not_loopback(seen)
    assert {role for role, _, _ in exposed} == {"launcher"}, seen  # the agent alone
    assert {address for _, address, _ in exposed} <= {"::", "0.0.0.0"}, seen


def test_torchrun_with_a_file_rendezvous_exposes_rank_0s_store_today(tiny_mnist, tmp_path):
    """With a file rendezvous the agent shares no store and listens on nothing, and the workers
    meet in the TCP store that rank 0 hosts at MASTER_PORT (env://), which listens on every
    interface whatever address it is given (pytorch/pytorch#173909). (The scripts no longer
    work around it: docs/security.md.) If this fails, torch has changed: update that page."""
    seen = listening_while_it_runs(
        [*TORCHRUN, "--rdzv-backend=c10d", "--rdzv-conf=store_type=file",
         f"--rdzv-endpoint={tmp_path / 'rendezvous'}", "--nnodes=1", "--nproc-per-node=2",
         "torchrun_ddp.py", "--data-dir", tiny_mnist, *ARGS],
        env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert not {s for s in seen if s[0] == "launcher"}, seen  # the agent: nothing
    exposed = not_loopback(seen)
    assert len(exposed) == 1 and {a for _, a, _ in exposed} <= {"::", "0.0.0.0"}, seen
