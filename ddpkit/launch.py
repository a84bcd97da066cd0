"""The processes' lives: who each is in its job (Place, worked out once from what its launcher
gives), where they meet when the script itself must say (spawn_ddp.py's store; torchrun's,
with a meeting of this round), how each ends (one line, an exit code, and leaving the process
group at once), and mp.spawn's worker and launcher. docs/clusters.md."""
import atexit
import contextlib
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import connection
from typing import NamedTuple

import torch.distributed as dist

from common import Fatal, say

from . import machine, sigterm
from .task import failure


class Place(NamedTuple):
    """Who a process is in its job: its rank of world_size, its local_rank of the nproc on its
    machine, and that machine's index. Worked out once, from what its launcher gives."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    nproc: int = 1
    node: int = 0
    who: str = ""  # before each line it says: "[rank N] " where a launcher started it


def spawn_place(args, local_rank):
    """spawn_ddp.py's processes: --nproc-per-node on each of --nnodes machines, numbered node
    by node (global rank = node_rank x nproc_per_node + local_rank)."""
    nproc = args.nproc_per_node
    rank = args.node_rank * nproc + local_rank
    return Place(rank, args.nnodes * nproc, local_rank, nproc, args.node_rank, f"[rank {rank}] ")


def torchrun_place():
    """A process started by torchrun, the old launcher, TorchX or SLURM through torchrun:
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK, its node's index. A Kubeflow
    PyTorchJob pod in its plain form has RANK and WORLD_SIZE only: one process, a node of its
    own. Without RANK: one process, no launcher."""
    env = os.environ
    if "RANK" not in env:
        return Place()
    rank, nproc = int(env["RANK"]), int(env.get("LOCAL_WORLD_SIZE", 1))
    return Place(rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), nproc,
                 int(env.get("GROUP_RANK", rank // nproc)), f"[rank {rank}] ")


# ---- How a process ends: one line, never a traceback ------------------------------------

# gloo's RuntimeErrors for a peer that died or stopped answering (most name a gloo source file)
GLOO_LOST_PEER = ("/gloo/", "Application timeout caused pair closure", "Wait timeout")


SAY_LATE = 3  # seconds (clean_exit)


@contextlib.contextmanager
def clean_exit(place=Place()):
    """Every ending as one line on stderr, after the process's rank: exit code 2 for bad input
    (refused alike by every process of a node: said by its first at once, by another only if it
    is still there SAY_LATE seconds later: torchrun's agent and spawn's launcher end the others
    when one exits, and the first may be late, or gone already), 1 for a lost peer or an
    error in the code (a bug in the task, CUDA out of memory; its frames follow), 130 for Ctrl-C,
    143 after a SIGTERM. A process that leaves on an error of its own leaves its process group
    first (`leave_group`), so that the others fail at once instead of waiting out --timeout."""
    try:
        yield
        end(0)
    except Fatal as e:  # bad input, a SIGTERM (sigterm.Preempted)
        line, code = str(e) and f"{e.says}: {e}", e.code
        if code == Fatal.code and place.local_rank != 0:
            sigterm.default()  # its node's first process says it, and this one is ended
            time.sleep(SAY_LATE)
    except KeyboardInterrupt:
        line, code = "interrupted", 130
    except Exception as e:
        if isinstance(e, dist.DistError) or (  # a peer died or never came, a port is taken;
                isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_LOST_PEER)):
            line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            line = re.sub(r"^\[\S+\] ", "", line)  # without gloo's "[source.cc:123] "
            say(f"{place.who}error: distributed: {line[:300]}")  # (gloo: a plain RuntimeError)
            sys.stdout.flush()  # the group is broken: no teardown, where gloo's threads can abort
            os._exit(1)
        line, code = failure(e)
        line = f"error: {line}"
    if line:
        say(place.who + line)
    leave_group()
    end(code)  # outside the except: the failed frames are released first


def end(code):
    """The process's end, without the interpreter's finalization: gloo's threads outlive
    destroy_process_group where something still holds the group (after fully_shard, DTensor's
    caches keep its DeviceMesh), and one that frees a collective's tensors once Python finalizes
    aborts the process ("terminate called without an active exception", exit -6: 3 FSDP runs in
    27 here; pytorch/pytorch#190489, Python before 3.14: python/cpython#87135). What Python's
    exit does before that still runs, in its order: threading's exit hooks, where
    concurrent.futures stops its idle pool workers (an inductor compile's, a task's reader:
    joined without them, such a worker waits forever), then the other threads finish, the atexit
    functions run (data workers, logging), and the output is flushed."""
    threading._shutdown()  # what the interpreter's exit calls first (CPython 3.8 to 3.14)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_group():
    """Leaves the process group at once. gloo's is destroyed: its connections close, and the
    others' collectives fail. NCCL's is aborted: from 2.6 on, destroy waits for the others'
    work to finish, which a failed process never will, and the abort is given the world group
    by name (2.6's abort of no group aborts the default one's backend and leaves the rest); in
    2.4 and 2.5, which have no abort, destroy aborts (ProcessGroupNCCL::shutdown calls abort)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):  # leaving anyway: the process ends with its own line
        if abort and dist.get_backend() != "gloo":
            abort(dist.group.WORLD)
        else:
            dist.destroy_process_group()


# ---- Where the processes meet, where the script itself says ------------------------------

def on_loopback():
    """All processes on this machine: gloo's and NCCL's sockets on loopback, where no other
    machine reaches them (they would listen where the host name resolves, on a laptop perhaps
    nowhere: pytorch/pytorch#26049). Variables the user set win. docs/security.md."""
    with contextlib.suppress(AttributeError, OSError):
        names = [name for _, name in socket.if_nameindex()]
        lo = next((n for n in names if n.startswith("lo")), None)
        if lo:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def spawn_store(args, place, store_file, device):
    """Where spawn_ddp.py's processes meet. One machine: a file in the launcher's private folder
    (no port). Several, or --master-port: a TCP store that rank 0 hosts on node 0 (on every
    interface: docs/security.md), in which the nodes first check that all run as many processes.
    Then all meet (`meet`)."""
    if args.master_port is None:
        on_loopback()
        return meet(dist.FileStore(store_file, place.world_size), place, args, backend(device))
    store = dist.TCPStore(args.master_addr or "127.0.0.1", args.master_port,
                          is_master=place.rank == 0, timeout=timedelta(seconds=args.join_timeout))
    store.set(f"nproc/{place.node}", str(place.nproc))
    counts = [int(store.get(f"nproc/{n}")) for n in range(args.nnodes)]
    if len(set(counts)) > 1:  # their ranks would collide
        read_by_all(store, "nproc/read", place.rank, sum(counts), args.join_timeout)
        raise Fatal(f"every node must run the same --nproc-per-node; nodes 0..{args.nnodes - 1} "
                    f"run {', '.join(map(str, counts))}")
    return meet(store, place, args, backend(device))


def torchrun_store(args, place, device):
    """The store that init_process_group would make from torchrun's environment (MASTER_ADDR,
    MASTER_PORT), without torch 2.4's prefix (this node's restart count, which a replaced node
    does not share), after the meeting (`meet`), under the prefix of this round. One process:
    one in memory."""
    if place.nproc == place.world_size:
        on_loopback()
    if place.world_size == 1:
        return dist.HashStore()
    store = next(dist.rendezvous("env://", timeout=timedelta(seconds=args.join_timeout)))[0]
    store = getattr(store, "underlying_store", store)  # 2.4: a PrefixStore; 2.15: the store
    return meet(store, place, args, backend(device))


def backend(device):
    return f"{'nccl' if device.type == 'cuda' else 'gloo'} on {device.type}"


def meet(store, place, args, kind):
    """Every process checks in and waits for all, in a round that rank 0 opens under a new token:
    torchrun's agent keeps its store from round to round (pytorch/pytorch#167288) and
    TORCHELASTIC_RESTART_COUNT counts per node (a replaced node starts at 0), so a token whose
    round is over, or never formed, is an earlier round's: the process looks again until rank
    0's new one is there. --join-timeout bounds that wait, and names who never came. Rank 0
    refuses a node whose processes would use another backend (a GPU not seen: gloo beside
    NCCL). Returns the store under the round's prefix, waiting --timeout: init_process_group
    keeps a given store's timeout (only its init_method path sets one), and NCCL fetches its
    unique id through it inside the call, while a node may still be preparing its data."""
    rank, world_size, mine = place.rank, place.world_size, f"{place.node} {kind}"
    store.set_timeout(timedelta(seconds=args.join_timeout))
    deadline, token = time.monotonic() + args.join_timeout, None
    try:
        if rank == 0:
            token = secrets.token_hex(8)
            store.set("round", token)
            store.set(f"{token}/0", mine)
            store.wait([f"{token}/{r}" for r in range(world_size)])
            others = [store.get(f"{token}/{r}").decode().split(" ", 1) for r in range(world_size)]
            kinds = sorted({k for _, k in others})  # "gloo on cpu" first: a node without GPUs
            odd = sorted({int(n) for n, k in others if k == kinds[0]}) if kinds[1:] else []
            verdict = f"the processes of node(s) {', '.join(map(str, odd))} would train with " \
                f"{kinds[0]}, the others with {kinds[-1]}: every node must see its GPUs (check " \
                "its driver with nvidia-smi)" if odd else ""
            store.set(f"{token}/all", verdict)
        pause = 0.01  # (polled: a TCPStore client whose wait timed out answers out of turn)
        while rank != 0:
            seen = store.get("round").decode()
            if store.check([f"{seen}/all"]):  # a round that is over: ours, or the last one's
                if seen == token:
                    break
            elif seen != token:
                token = seen
                store.set(f"{token}/{rank}", mine)
            if time.monotonic() > deadline:
                raise dist.DistStoreError("")
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        if rank != 0:
            verdict = store.get(f"{token}/all").decode()
        if verdict:
            read_by_all(store, f"{token}/read", rank, world_size, args.join_timeout)
            raise Fatal(verdict)
    except RuntimeError as e:  # a store that waited --join-timeout (a FileStore's: not a DistError)
        if not isinstance(e, dist.DistError) and "imeout" not in str(e):
            raise
        missing = [str(r) for r in range(world_size)
                   if not store.check([f"{token}/{r}"])] if token else ["0"]
        raise dist.DistStoreError(f"rank(s) {', '.join(missing) or '?'} did not come within "
                                  f"--join-timeout {args.join_timeout:g} s") from None
    store = dist.PrefixStore(f"{token}/", store)
    store.set_timeout(timedelta(seconds=args.timeout))
    return store


def load_data(store, place, args, task):
    """The task's datasets, in every process before any enters init_process_group: the first
    process of each machine prepares the data (a download), the others wait for it, then each
    makes its own. A process that fails says so in the store, and the others end at once with a
    line that names it (they would wait --timeout in init_process_group for it)."""
    node, keys = f"prepared/{place.node}", [f"loaded/{r}" for r in range(place.world_size)]
    try:
        if place.local_rank == 0:
            try:
                task.prepare_data(args)
            finally:  # the others go on, and fail by themselves if it did
                store.set(node, "")
        store.wait([node], timedelta(seconds=args.timeout))
        datasets = task.make_datasets(args)
    except BaseException:
        store.set(keys[place.rank], "failed")
        raise
    store.set(keys[place.rank], "")
    store.wait(keys, timedelta(seconds=args.timeout))
    lost = [str(r) for r, v in enumerate(store.multi_get(keys)) if v]  # one request, not N
    if lost:
        raise dist.DistStoreError(f"rank(s) {', '.join(lost)} could not load the data (their "
                                  "own lines say why)")
    return datasets


def set_timeout(args, steady):
    """The process group's timeout from here on (torchtitan's form): --step-timeout (if shorter)
    once `steady`, after an epoch's second step (its all-reduce waited for every process's first,
    which may compile), so that a lost peer is seen soon; --timeout before then and around a
    checkpoint write. torch 2.4's gloo keeps the one it started with."""
    seconds = min(args.step_timeout, args.timeout) if steady else args.timeout
    (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(
        timedelta(seconds=seconds))


def read_by_all(store, key, rank, world_size, seconds):
    """Before a refusal read from the store: each process counts itself at `key`, and rank 0,
    which hosts the store on several nodes, leaves only once all have read (`seconds` at most)."""
    store.add(key, 1)
    deadline = time.monotonic() + seconds
    while rank == 0 and store.add(key, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def worker(local_rank, train, args, private):
    """mp.spawn's target: train(), its error one line that names the rank."""
    place = spawn_place(args, local_rank)
    with clean_exit(place):
        # NCCL: a collective that fails or times out takes its process down, as under torchrun
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        machine.deterministic(args.deterministic)  # (a spawned interpreter: parsed nothing)
        train(place, args, os.path.join(private, "store"))


def join(workers, args, say_within=5, grace=30):
    """spawn_ddp.py's launcher: waits for its processes and ends as the first that failed, with
    its exit code, adding nothing to what it said. The others get `say_within` seconds to end by
    themselves (none after a refusal, which was said: clean_exit), then SIGTERM, and SIGKILL
    `grace` s later: one stuck in a collective ignores a SIGTERM (sigterm.StopSignal). A
    SIGTERM to the launcher alone (`kill PID`) goes on to them (sigterm.forward)."""
    processes = workers.processes
    sigterm.forward(processes)
    try:
        alive = processes
        while alive and not any(p.exitcode for p in processes):
            connection.wait([p.sentinel for p in alive])  # until one of them ends
            alive = [p for p in processes if p.is_alive()]
        failed = next((i for i, p in enumerate(processes) if p.exitcode), None)
        if failed is not None and processes[failed].exitcode == Fatal.code:
            say_within = 0  # refused, and said (clean_exit): the others would say it again
        for seconds, end in ((say_within, "terminate"), (grace, "kill")):
            deadline = time.monotonic() + seconds
            [p.join(max(0, deadline - time.monotonic())) for p in processes]
            [getattr(p, end)() for p in processes if p.is_alive()]
    finally:  # Ctrl-C
        [p.terminate() for p in processes if p.is_alive()]
    if failed is not None:
        code = processes[failed].exitcode
        if code < 0:  # killed by a signal (the OOM killer's SIGKILL), it could say nothing
            say(f"{spawn_place(args, failed).who}error: killed by {signal.Signals(-code).name}")
        sys.exit(max(code, 1))
