"""What the run says: rank 0's lines on the console, in --metrics and in --tensorboard's curves
(the same numbers, from one place), and each epoch's loss, samples and seconds (EpochStats),
gathered on the device without a sync per step."""
import json
import math
import os
import time

import torch
import torch.distributed as dist

import common


class Reporter:
    def __init__(self, args, place, device):
        self.on, self.args, self.world_size = place.rank == 0, args, place.world_size
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        nodes = place.world_size // place.nproc
        self.log(f"{place.world_size} processes ({nodes} node(s) x {place.nproc})"
                 f"{f', backend {dist.get_backend()}' if dist.is_initialized() else ''}, device "
                 f"{device.type}, {torch.get_num_threads()} thread(s) each"
                 f"{f', restart {restart} (TORCHELASTIC_RESTART_COUNT)' if restart else ''}")
        if getattr(args, "gpus", None) and device.type == "cuda":  # dp_baseline.py
            self.log(f"DataParallel over GPU(s) {args.gpus}, gathering on {device}")
        self.log(f"task {args.task or 'common.py'}")
        self.board, self.steps = None, 0

    def start(self, epoch, step, steps, optimizer):
        """Says the LR the training starts from (an evaluation trains nothing): --lr at batch
        256 scaled by --lr-scaling, or where the task's own optimizer starts elsewhere, that.
        Training continues after `step` steps of epoch `epoch` (0, 0: a new run), `steps` an
        epoch: the same at any world size, ceil(samples / global batch) (less a batch of one
        left out, data.drop_last). --tensorboard's curves go on at the next global step in the
        folder's run; from that step on, what an earlier run wrote there (after the snapshot it
        stopped at) is dropped when TensorBoard reads the folder (purge_step): every step once,
        in order. --evaluate writes nothing."""
        args, self.steps = self.args, steps
        group = optimizer.param_groups[0]
        lr, peak = group.get("initial_lr", group["lr"]), common.peak_lr(args)  # (before warmup)
        if not args.evaluate:
            self.log(f"LR {args.lr:g} at batch {common.REFERENCE_BATCH} -> {peak:.4g} at "
                     f"{args.batch_size} ({common.LR_RULES[args.lr_scaling]})"
                     if math.isclose(lr, peak, rel_tol=1e-6) else f"LR {lr:.4g}: the task's own "
                     f"{type(optimizer).__name__} recipe (--lr and --lr-scaling do not set it)")
        if self.on and args.tensorboard and not args.evaluate:
            from torch.utils.tensorboard import SummaryWriter  # 0.3 s of imports: rank 0's only
            self.board = SummaryWriter(args.tensorboard, purge_step=epoch * steps + step + 1)

    def log(self, msg):
        if self.on:
            print(msg, flush=True)

    def progress(self, epoch, step, steps, loss, lr, stats):
        rate = stats.seen * self.world_size / max(time.perf_counter() - stats.start, 1e-9)
        self.log(f"epoch {epoch + 1}/{self.args.epochs} step {step}/{steps} loss {loss:.4f} "
                 f"lr {lr:.3g} {rate:.0f} samples/s")
        self.curves("step", epoch * steps + step, train_loss=loss, lr=lr, samples_per_s=rate)

    def record(self, **fields):
        """One epoch (or an evaluation): a line on the console, a JSON line in --metrics."""
        fields["world_size"] = self.world_size
        self.log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in fields.items()))
        if self.on and self.args.metrics:
            with open(self.args.metrics, "a") as f:
                f.write(json.dumps(fields) + "\n")
        self.curves("epoch", fields["epoch"] * self.steps, **fields)

    def curves(self, prefix, step, **fields):
        """--tensorboard: each number as the curve PREFIX/KEY (step/train_loss, epoch/test_acc),
        at the global step, on the disk at once: a snapshot never holds a step the file lacks."""
        if self.board:
            for k, v in fields.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch":
                    self.board.add_scalar(f"{prefix}/{k}", v, step)
            self.board.flush()


class EpochStats:
    """One epoch of one process: its loss summed on the device (no sync per step), the samples
    it trained, its seconds (after the GPU's queued work) and the time it waited for batches;
    an epoch resumed after `skipped` of its `steps` says that it covers only the rest."""

    def __init__(self, device, skipped=0, steps=0):
        self.device, self.seen, self.data_wait = device, 0, 0.0
        self.skipped, self.steps = skipped, steps
        self.loss_sum, self.start = torch.zeros((), device=device), self.now()

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timed(self, loader):
        batches, start = iter(loader), time.perf_counter()
        for batch in batches:
            self.data_wait += time.perf_counter() - start
            yield batch
            start = time.perf_counter()

    def add(self, loss, n):
        self.loss_sum += loss.detach() * n
        self.seen += n

    def speed(self, world_size):
        seconds = self.now() - self.start
        partial = {"partial": f"steps {self.skipped + 1}-{self.steps} of {self.steps} (resumed)"}
        return {"epoch_seconds": seconds, "samples_per_s": self.seen * world_size / seconds,
                "data_wait": self.data_wait / seconds, **(partial if self.skipped else {})}
