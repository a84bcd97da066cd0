"""Stopping and resuming exactly: a SIGTERM, a crash or a resize costs no more than the steps
since the last snapshot, and a resumed run ends bit-identical to one never stopped. The lesson
never needs to open this file; docs/flags.md says which flags need what it holds: the stop on
SIGTERM, resuming together, skipping in the sampler, random numbers per sample and per step,
micro-batches, and data workers that share memory and outlive a SIGTERM not meant for them."""
import contextlib
import hashlib
import itertools
import os
import random
import signal
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import Dataset, Sampler

import common
from common import Fatal


class Preempted(Exception):
    """SIGTERM arrived and the run stopped: exit code 143, and the message, if any, on stderr."""


AGREE_EVERY = 1.0  # seconds: about how often the processes agree on a stop


class StopSignal:
    """SIGTERM, what SLURM, Kubernetes and torchrun send before they kill a job. Without a
    checkpoint it stops the process at once, as Ctrl-C does. With one, the handler sets a flag,
    and the processes add up their flags in one all-reduce on the training backend: before an
    epoch's first and last steps, and about every AGREE_EVERY seconds between them. All stop
    at the same step, and the snapshot is one model. The same all-reduce carries each process's
    seconds per step since the last check; the slowest one sets how many steps the next check
    is away, the same number in every process. So a stop comes within about a second or a step,
    whichever is longer, however long steps take (a grace time of 30 s, SLURM's KillWait and
    torchrun's, must hold that and the write), and fast steps pay one small all-reduce a second."""

    def __init__(self, checkpoint, device, steps):
        self.received, self.device, self.steps = False, device, steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.agree = checkpoint and dist.is_initialized() and dist.get_world_size() > 1
        self.next, self.last = 0, None  # the step of the next check; (step, time) of the last
        signal.signal(signal.SIGTERM, self._received if checkpoint else self._stop_now)

    def _received(self, signum, frame):
        self.received = True

    def _stop_now(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: once is enough
        raise Preempted("stopped on SIGTERM; nothing saved (no --checkpoint)" * (self.rank == 0))

    def __call__(self, step):
        """Called by every process before every step: True when all are to stop before `step`."""
        if not self.agree:
            return self.received
        first = self.last is None or step <= self.last[0]  # a new epoch (or a resumed one)
        if not (first or step >= self.next or step == self.steps):
            return False
        per_step = 0.0 if first else (time.perf_counter() - self.last[1]) / (step - self.last[0])
        both = torch.tensor([float(self.received), per_step], device=self.device)
        common.recent.append(both)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # anyone's flag; the slowest process's pace
        received, per_step = both.tolist()
        self.next = step + (max(1, int(AGREE_EVERY / per_step)) if per_step > 0 else 1)
        self.last = (step, time.perf_counter())
        return received > 0

    def stopped(self, checkpoint, epoch, step):
        """The exception that ends the run after the snapshot at `step` of `epoch`."""
        return Preempted(f"stopped on SIGTERM after step {step} of epoch {epoch + 1}; snapshot in "
                         f"{checkpoint}: rerun with --resume to continue" * (self.rank == 0))

    def close(self):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- Resuming together, the same run only ------------------------------------------------

NO_RESUME, RESUME_IF_FOUND, RESUME = 0, 1, 2  # what one process asks for
PIECE = 64 << 20  # the most bytes of a checkpoint sent at once to a process without a copy
# The flags that do not define a run: where files go, how the job is spread, started and
# reported, how fast it runs, and what this one invocation does. Every other flag defines it,
# a task's own too, except a task's flag named --*-dir, --*-path or --*-file (where its data
# is, not what). docs/preemption.md#one-run-one-checkpoint says why each is where it is.
NOT_THE_RUN = {"stop_after", "workers", "channels_last", "compile", "checkpoint", "save_every",
               "resume", "evaluate", "metrics", "log_interval", "save_on_each_node", "timeout",
               "join_timeout", "nproc_per_node", "nnodes", "node_rank", "master_addr",
               "master_port", "local_rank", "gpus", "native"}


def run_flags(args):
    """The flags that define the run of `args`, as {dest: value}; --amp auto is the checkpoint's
    precision when resuming (harness.settle_precision), so it is not compared."""
    return {k: v for k, v in vars(args).items() if k not in NOT_THE_RUN
            and not k.endswith(("_dir", "_path", "_file")) and (k, v) != ("amp", "auto")}


def check_same_run(args, ckpt, path):
    """Refuses, in one line, to continue a checkpoint that another run wrote: every flag that
    defines the run and that both know, with the value in the checkpoint and the value now."""
    then, now = ckpt.get("args", {}), run_flags(args)
    differ = [differs(k, then[k], v) for k, v in sorted(now.items()) if k in then and then[k] != v]
    if differ:
        raise Fatal(f"{path} is the checkpoint of another run: {'; '.join(differ)}. Give its "
                    "flags to continue it, or another --checkpoint to start a new run")


def differs(dest, then, now):
    """"--batch-size 256 in the checkpoint, 128 now"; "--dummy now, not in the checkpoint"."""
    flag = "--" + dest.replace("_", "-")
    if isinstance(then, bool) or isinstance(now, bool):
        return f"{flag} {'in the checkpoint, not now' if then else 'now, not in the checkpoint'}"
    return f"{flag} {then if then is not None else '(not given)'} in the checkpoint, " \
           f"{now if now is not None else '(not given)'} now"


def agreed_checkpoint(args, wish, device, log=print):
    """The checkpoint every process resumes from, or None, decided by all together: each says
    what it asks for, which snapshot it sees (nodes may have disks of their own), its node and
    the run its flags define. They resume if any asks to and any has a snapshot, all from the
    newest; processes without it (a node that joins with an empty disk) or with an older one
    receive the file from the first rank that has it, one copy per node. So no process runs
    other collectives than the rest. A checkpoint of another run, or processes started with
    different flags, are refused before anything is written; --evaluate compares nothing."""
    path = args.checkpoint
    ckpt = common.load_checkpoint(path) if wish and path and os.path.exists(path) else None
    node = int(os.environ.get("GROUP_RANK", getattr(args, "node_rank", 0)))  # torchrun's, spawn's
    run = mix(*sorted(run_flags(args).items()))
    everyone = [(wish, *((ckpt["epoch"], ckpt.get("step", 0)) if ckpt else (-1, -1)), node, run)]
    if dist.is_initialized():  # tensors, not all_gather_object: nothing unpickled from others
        mine = torch.tensor(everyone[0], device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        common.recent.extend([mine, *gathered])
        dist.all_gather(gathered, mine)
        everyone = [tuple(t.tolist()) for t in gathered]
    # A refusal is said once per node, by its first process; the others end quietly.
    says = dist.get_rank() == next(r for r, e in enumerate(everyone) if e[3] == node) \
        if dist.is_initialized() else True
    other = [r for r, e in enumerate(everyone) if e[4] != everyone[0][4]]
    if other:
        raise Fatal(f"the processes of rank(s) {', '.join(map(str, other))} were started with "
                    "other flags than rank 0's; give every node the same command" * says)
    wish, newest = max(e[0] for e in everyone), max(e[1:3] for e in everyone)
    if wish == NO_RESUME or (newest == (-1, -1) and wish == RESUME_IF_FOUND):
        return None
    if newest == (-1, -1):
        raise Fatal(f"no checkpoint at {path}" + " on any node" * (len(everyone) > 1))
    behind = [r for r, e in enumerate(everyone) if e[1:3] != newest]
    if behind:
        source = next(r for r, e in enumerate(everyone) if e[1:3] == newest)
        log(f"rank(s) {', '.join(map(str, behind))} had no copy of {path} at {newest[0]} "
            f"epoch(s) + {newest[1]} step(s): rank {source} sends its copy")
        here = [r for r in behind if everyone[r][3] == node]  # this node's ranks without it
        received = send_file(path, source, here, node, device)
        ckpt = common.load_checkpoint(received) if received else ckpt
        dist.barrier()  # every process of its node has mapped the copy: the writer removes it
        if received and dist.get_rank() == here[0]:
            with contextlib.suppress(OSError):  # (Windows cannot remove a mapped file)
                os.remove(received)
    if not args.evaluate:
        try:
            check_same_run(args, ckpt, path)
        except Fatal as e:
            raise Fatal(str(e) * says) from None
    return ckpt


def send_file(path, source, here, node, device):
    """Rank `source`'s file `path`, in pieces of at most PIECE bytes (on the GPU with NCCL);
    every rank takes part. The first of `here`, this node's ranks without the file, writes the
    pieces to one file for node number `node`, beside `path` where that folder exists (else in
    the temporary folder), and the others of `here` read that copy: its name is returned to
    each of them, None to the other ranks."""
    rank = dist.get_rank()
    size = torch.tensor([os.path.getsize(path) if rank == source else 0], device=device)
    common.recent.append(size)
    dist.broadcast(size, src=source)
    size = int(size)  # (one wait for the device, not one a piece)
    buffer = torch.empty(min(PIECE, size), dtype=torch.uint8, device=device)
    common.recent.append(buffer)
    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if not os.path.isdir(folder):  # a node without the checkpoint's folder
        folder, name = tempfile.gettempdir(), f"{mix(os.path.abspath(path)):x}-{name}"
    copy = os.path.join(folder, f".{name}.node{node}.received")
    writes = here[:1] == [rank]
    with open(path, "rb") if rank == source else contextlib.nullcontext() as f, \
            open(copy, "wb") if writes else contextlib.nullcontext() as out:
        for offset in range(0, size, PIECE):
            piece = buffer[:min(PIECE, size - offset)]
            if rank == source:
                piece.copy_(torch.frombuffer(bytearray(f.read(len(piece))), dtype=torch.uint8))
            dist.broadcast(piece, src=source)
            if out:
                out.write(piece.cpu().numpy().tobytes())
    dist.barrier()  # the copy is whole before its node's other ranks read it
    return copy if rank in here else None


def restore(ckpt, model, optimizer, scheduler, scaler, path, log=print):
    """A checkpoint (or None) loaded into freshly built objects: (epoch, step) to continue from.
    The checkpoint is emptied, so that the file it maps (perhaps a received copy) is let go."""
    if not ckpt:
        return 0, 0
    load_model_state(model, ckpt["model"], path)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler") and scaler.is_enabled():  # a checkpoint without fp16 has no scale
        scaler.load_state_dict(ckpt["scaler"])
    position = ckpt["epoch"], ckpt.get("step", 0)
    log(f"loaded {path}: {position[0]} epoch(s) + {position[1]} step(s) trained")
    ckpt.clear()
    return position


def load_model_state(model, state_dict, path, assign=False):
    """Strict load; a "module." prefix from an old DataParallel/DDP save is stripped first."""
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    try:
        model.load_state_dict(state_dict, assign=assign)
    except RuntimeError as e:
        detail = " ".join(ln.strip() for ln in str(e).splitlines()[1:3])
        raise Fatal(f"checkpoint {path} does not fit this model: {detail[:300]}") from None


class Skippable(Sampler):
    """A sampler whose next pass leaves out its first `skip` indices: a resume in the middle of
    an epoch skips what was trained, and nothing is loaded for it."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


# ---- Random numbers that depend on (seed, epoch, sample or step, rank) only ----------------

def mix(*values):
    """A 63-bit seed from a tuple of integers, well spread (blake2b)."""
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(),
                          "little") >> 1


class PerSampleSeeds(Dataset):
    """A training set whose draws from torch's and Python's global RNG (random augmentation)
    are seeded per sample from (seed, epoch, index): different on every rank and in every epoch,
    the same at any world size, with any workers, after a resume. (DataLoader would seed its
    workers from each process's RNG, the same on every rank.) The epoch is in shared memory, so
    that the workers see set_epoch too. A dataset that returns whole batches (__getitems__) is
    seeded once per batch, from its first index."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()
        if callable(getattr(dataset, "__getitems__", None)):
            self.__getitems__ = self._getitems

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def _seed(self, index):
        seed = mix(self.seed, int(self.epoch), int(index))
        torch.default_generator.manual_seed(seed)
        random.seed(seed)

    def __getitem__(self, index):
        self._seed(index)
        return self.dataset[index]

    def _getitems(self, indices):
        self._seed(indices[0])
        return self.dataset.__getitems__(indices)


def seed_step(seed, epoch, step, rank, gpus=None):
    """Seeds this process's RNG before a forward pass: dropout draws differently on every rank,
    and again the same after a resume. Micro-batch k of --accumulate passes the rank that would
    compute it with N times the processes. Dropout on a GPU draws from that GPU's generator:
    this process's GPU, or each of `gpus` (DataParallel's replicas), each seeded on its own."""
    torch.default_generator.manual_seed(mix(seed, epoch, step, rank))  # (torch.manual_seed:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # 0.1 ms a call on a CPU)
        for i, gpu in enumerate([torch.cuda.current_device()] if gpus is None else gpus):
            torch.cuda.default_generators[gpu].manual_seed(mix(seed, epoch, step, rank, i))


def micro_batches(inputs, target, n):
    """--accumulate n: (inputs, target, share, last) for each micro-batch k, which takes every
    n-th sample from the k-th, of every tensor of the batch: what rank r + W*k of W*n processes
    would get. Each loss is weighted by its share, so that the gradients add up to the batch's."""
    def take(x, k):
        if isinstance(x, dict):
            return {name: take(v, k) for name, v in x.items()}
        return type(x)(take(v, k) for v in x) if isinstance(x, (tuple, list)) else x[k::n]
    n = min(n, len(target))  # a last batch shorter than n gives no empty micro-batch
    for k in range(n):
        yield take(inputs, k), target[k::n], len(target[k::n]) / len(target), k == n - 1


# ---- Data workers ---------------------------------------------------------------------------

def worker_options(workers):
    """The DataLoader's worker options. Forked from the training process, the workers share its
    memory: the dataset is neither copied into /dev/shm nor sent over one descriptor per tensor
    ("too many fds"), as with a fork server or spawn. They start once (start_workers), before
    the process group: a fork while its threads run can hang the child on CPython before 3.11.10
    (python/cpython#112275). Elsewhere than Linux: the platform's way."""
    if not workers:
        return {}
    return {"persistent_workers": True, "worker_init_fn": worker_init,
            "multiprocessing_context": "fork" if sys.platform == "linux" else None}


def start_workers(*loaders):
    """The loaders' workers, started now, with an empty sampler (nothing is loaded until the
    first epoch asks) and SIGTERM blocked in them until worker_init takes it over: blocked in
    this thread meanwhile, as a signal mask survives fork (Windows has none)."""
    if hasattr(signal, "pthread_sigmask"):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        for loader in loaders:
            if loader.num_workers:
                sampler, loader.batch_sampler.sampler = loader.batch_sampler.sampler, []
                iter(loader)
                loader.batch_sampler.sampler = sampler
    finally:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def worker_init(worker_id):
    """A SIGTERM to the whole job (SLURM's scancel, torchrun's os.killpg) reaches the data
    workers too, and PyTorch's handler lets a worker die of one its parent did not send: the
    training process then fails before it can save. Here a worker exits on a SIGTERM from its
    training process (the DataLoader ending it) and ignores any other; the training process
    stops the run. Linux (sigwaitinfo); elsewhere PyTorch's handler."""
    if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
        parent = os.getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # here and in later threads

        def wait_for_sigterm():
            while True:
                if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                    os._exit(0)  # what PyTorch's handler does for a SIGTERM from the parent
        threading.Thread(target=wait_for_sigterm, name="sigterm", daemon=True).start()
    elif hasattr(signal, "pthread_sigmask"):  # macOS
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
