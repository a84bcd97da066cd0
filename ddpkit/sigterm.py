"""SIGTERM, what SLURM, Kubernetes and torchrun send before they kill a job, wherever it lands:
the training processes stop together at one step and save there (StopSignal), the data
workers outlive one not meant for them (blocked, worker_init), and spawn_ddp.py's launcher
passes one sent to it alone on to its processes (forward). Nothing else installs a handler.
docs/preemption.md."""
import contextlib
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import common
from common import Fatal


class Preempted(Fatal):
    """SIGTERM arrived and the run stopped: exit code 143 (128 + 15, what shells report for
    "terminated"), and the message, if any, on stderr."""
    code, says = 143, "preempted"


AGREE_EVERY = 1.0  # seconds: about how often the processes agree on a stop


class StopSignal:
    """The training processes' SIGTERM. Without a checkpoint it stops the process at once, as
    Ctrl-C does. With one, the handler sets a flag, and the processes add up their flags in one
    all-reduce on the training backend: before an epoch's first and last steps, and about every
    AGREE_EVERY seconds between them. All stop at the same step, and the snapshot is one model.
    The same all-reduce carries each process's seconds per step since the last check; the
    slowest one sets how many steps the next check is away, the same number in every process.
    So a stop comes within about a second or a step, whichever is longer, however long steps
    take (a grace time of 30 s, SLURM's KillWait and torchrun's, must hold that and the write),
    and fast steps pay one small all-reduce a second."""

    def __init__(self, checkpoint, device, steps, elastic=False):
        self.received, self.device, self.steps, self.elastic = False, device, steps, elastic
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
        both = torch.tensor([float(self.received), per_step], pin_memory=self.device.type ==
                            "cuda").to(self.device, non_blocking=True)  # tolist(): the one sync
        common.recent.append(both)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # anyone's flag; the slowest process's pace
        received, per_step = both.tolist()
        self.next = step + (max(1, int(AGREE_EVERY / per_step)) if per_step > 0 else 1)
        self.last = (step, time.perf_counter())
        return received > 0

    def stopped(self, checkpoint, epoch, step):
        again = "the same command continues from it (this script resumes by itself)" \
            if self.elastic else "rerun with --resume to continue"
        return Preempted(f"stopped on SIGTERM after step {step} of epoch {epoch + 1}; snapshot in "
                         f"{checkpoint}: {again}" * (self.rank == 0))

    def close(self):
        default()


def default():
    """SIGTERM's default action again: it ends the process at once, where it waits for nothing
    (the training is over, or a process waits to say a refusal that another may say first)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- The data workers: a SIGTERM to the whole job reaches them too --------------------------

@contextlib.contextmanager
def blocked():
    """SIGTERM blocked in this thread meanwhile, so that data workers forked now start with it
    blocked (a signal mask survives fork) until worker_init takes it over. Windows has no mask."""
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


# ---- spawn_ddp.py's launcher ----------------------------------------------------------------

def forward(processes):
    """A SIGTERM to the launcher alone (`kill PID`) goes on to its processes, which stop; a
    second one kills them (one stuck in a collective runs no Python handler, and cannot)."""
    def stop(*_):  # from the first on, a SIGTERM kills them
        [p.terminate() for p in processes if p.is_alive()]
        signal.signal(signal.SIGTERM, lambda *_: [p.kill() for p in processes if p.is_alive()])
    signal.signal(signal.SIGTERM, stop)
