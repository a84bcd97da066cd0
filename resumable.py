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

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import Dataset, Sampler

import common
from common import Fatal


class Preempted(Exception):
    """SIGTERM arrived and the run stopped: exit code 143, and the message, if any, on stderr."""


CHECK_EVERY = 10  # steps: how often the processes agree on a stop, the most a stop waits


class StopSignal:
    """SIGTERM, what SLURM, Kubernetes and torchrun send before they kill a job. Without a
    checkpoint it stops the process at once, as Ctrl-C does. With one, the handler sets a flag,
    and every CHECK_EVERY steps (and before an epoch's last) the processes add up their flags in
    one all-reduce of one number on the training backend: all stop at the same step, and the
    snapshot is one model. Keep CHECK_EVERY steps shorter than the scheduler's grace time (30 s
    by default for SLURM's KillWait and Kubernetes)."""

    def __init__(self, checkpoint, device, steps):
        self.received, self.device, self.steps = False, device, steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.agree = checkpoint and dist.is_initialized() and dist.get_world_size() > 1
        signal.signal(signal.SIGTERM, self._received if checkpoint else self._stop_now)

    def _received(self, signum, frame):
        self.received = True

    def _stop_now(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: once is enough
        raise Preempted("stopped on SIGTERM; nothing saved (no --checkpoint)" * (self.rank == 0))

    def __call__(self, step):
        """Called by every process before every step: True when all are to stop before `step`."""
        if not self.agree or not (step % CHECK_EVERY == 0 or step == self.steps):
            return self.received and not self.agree
        flag = torch.tensor([float(self.received)], device=self.device)
        common.recent.append(flag)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return flag.item() > 0

    def stopped(self, checkpoint, epoch, step):
        """The exception that ends the run after the snapshot at `step` of `epoch`."""
        return Preempted(f"stopped on SIGTERM after step {step} of epoch {epoch + 1}; snapshot in "
                         f"{checkpoint}: rerun with --resume to continue" * (self.rank == 0))

    def close(self):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- Resuming together ----------------------------------------------------------------------

NO_RESUME, RESUME_IF_FOUND, RESUME = 0, 1, 2  # what one process asks for
PIECE = 64 << 20  # the most bytes of a checkpoint sent at once to a process without a copy


def agreed_checkpoint(path, wish, device, log=print):
    """The checkpoint every process resumes from, or None, decided by all together: each says
    what it asks for and which snapshot it sees (nodes may have disks of their own). They resume
    if any asks to and any has a snapshot, all from the newest; a process without it (a node
    that joins with an empty disk) or with an older one receives the file from the first rank
    that has it. So no process runs other collectives than the rest."""
    ckpt = common.load_checkpoint(path) if wish and path and os.path.exists(path) else None
    everyone = [(wish, *((ckpt["epoch"], ckpt.get("step", 0)) if ckpt else (-1, -1)))]
    if dist.is_initialized():
        mine = torch.tensor(everyone[0], device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        common.recent.extend([mine, *gathered])
        dist.all_gather(gathered, mine)
        everyone = [tuple(t.tolist()) for t in gathered]
    wish, newest = max(e[0] for e in everyone), max(e[1:] for e in everyone)
    if wish == NO_RESUME or (newest == (-1, -1) and wish == RESUME_IF_FOUND):
        return None
    if newest == (-1, -1):
        raise Fatal(f"no checkpoint at {path}" + " on any node" * (len(everyone) > 1))
    behind = [r for r, e in enumerate(everyone) if e[1:] != newest]
    if behind:
        source = next(r for r, e in enumerate(everyone) if e[1:] == newest)
        log(f"rank(s) {', '.join(map(str, behind))} had no copy of {path} at {newest[0]} "
            f"epoch(s) + {newest[1]} step(s): rank {source} sends its copy")
        received = send_file(path, source, dist.get_rank() in behind, device)
        ckpt = common.load_checkpoint(received.name) if received else ckpt
    return ckpt


def send_file(path, source, receive, device):
    """Rank `source`'s file `path` to every rank, in pieces of at most PIECE bytes (on the GPU
    with NCCL); where `receive`, into a temporary file, returned open (closed, it is gone)."""
    rank = dist.get_rank()
    size = torch.tensor([os.path.getsize(path) if rank == source else 0], device=device)
    common.recent.append(size)
    dist.broadcast(size, src=source)
    buffer = torch.empty(min(PIECE, int(size)), dtype=torch.uint8, device=device)
    common.recent.append(buffer)
    folder = os.path.dirname(os.path.abspath(path))  # the disk the checkpoint would be on
    out = receive and tempfile.NamedTemporaryFile(dir=folder if os.path.isdir(folder) else None)
    with open(path, "rb") if rank == source else contextlib.nullcontext() as f:
        for offset in range(0, int(size), PIECE):
            piece = buffer[:min(PIECE, int(size) - offset)]
            if rank == source:
                piece.copy_(torch.frombuffer(bytearray(f.read(len(piece))), dtype=torch.uint8))
            dist.broadcast(piece, src=source)
            if out:
                out.write(piece.cpu().numpy().tobytes())
    if out:
        out.flush()
    return out


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
    state_dict = dict(state_dict)
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


def seed_step(seed, epoch, step, rank):
    """Seeds this process's RNG before a forward pass: dropout draws differently on every rank,
    and again the same after a resume. Micro-batch k of --accumulate passes the rank that would
    compute it with N times the processes."""
    seed = mix(seed, epoch, step, rank)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)  # this process's GPU (dropout on CUDA draws from it)


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
    first epoch asks) and SIGTERM blocked in them until worker_init takes it over."""
    with sigterm_blocked():
        for loader in loaders:
            if loader.num_workers:
                sampler, loader.batch_sampler.sampler = loader.batch_sampler.sampler, []
                iter(loader)
                loader.batch_sampler.sampler = sampler


@contextlib.contextmanager
def sigterm_blocked():
    """SIGTERM blocked in this thread, and in every process started meanwhile (a signal mask
    survives fork); a no-op where there are no signal masks (Windows)."""
    before = None
    if hasattr(signal, "pthread_sigmask"):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
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
