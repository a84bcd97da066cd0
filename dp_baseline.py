"""nn.DataParallel: the single-process baseline that DDP replaced (docs/training.md).

    python dp_baseline.py [--gpus 0,1]     # every visible GPU (or those given), or the CPU
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common


def main():
    parser = common.build_parser(__doc__, processes=False)  # no --timeout, --save-on-each-node
    parser.add_argument("--gpus", type=common.gpu_ids, help="GPU ids, e.g. 0,1 (default: all)")
    args = parser.parse_args()

    gpus = list(range(torch.cuda.device_count())) if args.gpus is None else args.gpus
    common.check_args(args, world_size=1, local_processes=1, process_group=False)
    common.check_outputs(args)  # before any work that could be lost
    common.prepare_data(args)  # download once per machine, before training
    device = common.process_device(gpus[0] if gpus else 0, 1)  # inputs go to the first GPU
    common.say_once(f"DataParallel over GPU(s) {gpus}" if gpus else "no GPU: one process", device)
    wish = common.RESUME if args.resume or args.evaluate else common.NO_RESUME
    trainer = Trainer(args, device, gpus, wish)
    trainer.evaluate() if args.evaluate else trainer.train()


class Trainer:
    """One process's share of the training: set-up, one step, one epoch, a snapshot."""

    def __init__(self, args, device, gpus, wish):
        self.args, self.device, self.rank, self.world_size = args, device, 0, 1  # one process
        self.report = common.Reporter(args, self.rank, self.world_size)
        self.report.log(common.describe_lr(args))

        # Data: the sampler deals each process its own shard (the same seed everywhere, or the
        # shards overlap), and each process loads its part of the global batch. Augmentation
        # is drawn per sample from (seed, epoch, index): different on every rank.
        train_set, self.test_set = common.make_datasets(args)
        self.train_set = common.PerSampleSeeds(train_set, args.seed)
        self.sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0,
                                          shuffle=True, seed=args.seed)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size,
                                 sampler=common.ResumableSampler(self.sampler),
                                 num_workers=args.workers, worker_init_fn=common.worker_init,
                                 multiprocessing_context=common.worker_start(args.workers),
                                 pin_memory=device.type == "cuda", collate_fn=common.collate)
        self.steps = len(self.loader)

        # Model: the same seed, so the same initial weights in every process.
        torch.manual_seed(args.seed)
        self.layout = torch.channels_last if args.channels_last else torch.preserve_format
        model = common.make_model(args).to(device, memory_format=self.layout)
        self.optimizer = common.make_optimizer(model, args)
        self.scheduler = common.make_scheduler(self.optimizer, args, self.steps)
        self.amp = common.AMP_DTYPES[args.amp]
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16: none

        # Resume from --checkpoint: all processes decide together (common.agreed_checkpoint).
        self.epoch, self.step = 0, 0
        ckpt = common.agreed_checkpoint(args.checkpoint, wish, device, self.report.log)
        if ckpt:
            self.epoch, self.step = common.restore(ckpt, model, self.optimizer, self.scheduler,
                                                   self.scaler, args.checkpoint)
            self.report.log(f"loaded {args.checkpoint}: {self.epoch} epoch(s) + {self.step} "
                            "step(s) trained")
        self.lr = common.SchedulerAfterScaler(self.scheduler, self.scaler)

        # Every step: copied to every GPU, run in threads, gradients summed on the first GPU.
        self.model = nn.DataParallel(model, device_ids=gpus or None)
        # SIGTERM (a scheduler's notice): with a checkpoint, stop and save, all at one step.
        self.stop = common.StopSignal(snapshot=bool(args.checkpoint))

    def train(self):
        for epoch in range(self.epoch, self.args.epochs):
            self._run_epoch(epoch, first_step=self.step if epoch == self.epoch else 0)
            if epoch + 1 == self.args.stop_after:
                break
        self.stop.close()
        self.report.close()

    def evaluate(self):
        accuracy = common.accuracy_fields(*self._evaluate())
        self.report.record(epoch=self.epoch, evaluate=True, **accuracy)

    def _run_epoch(self, epoch, first_step):
        self.sampler.set_epoch(epoch)  # a new shuffle each epoch, else every epoch is the same
        self.train_set.set_epoch(epoch)  # and new augmentation
        # Resuming mid-epoch: set_epoch gives the same order as before; skip what was trained.
        self.loader.sampler.skip = first_step * self.loader.batch_size
        self.model.train()
        stats = common.EpochStats(self.device)
        for step, (x, y) in enumerate(stats.timed(self.loader), first_step + 1):
            if self.stop():  # SIGTERM: stop before this step, after a snapshot
                self._save_snapshot(epoch, step - 1)
                raise self.stop.stopped(self.args, epoch, step - 1)
            self._run_batch(epoch, step, x, y, stats)
            if step % self.args.log_interval == 0:
                loss = stats.loss_sum.item() / stats.seen
                lr = self.scheduler.get_last_lr()[0]
                self.report.progress(epoch, step, self.steps, loss, lr, stats)
            if self.args.save_every and step % self.args.save_every == 0 and step < self.steps:
                self._save_snapshot(epoch, step)
        train_loss = stats.loss_sum.item() / stats.seen
        speed = stats.speed(self.world_size)  # the epoch's, before the evaluation
        accuracy = common.accuracy_fields(*self._evaluate())
        self._save_snapshot(epoch + 1, 0)
        self.report.record(epoch=epoch + 1, train_loss=train_loss, **accuracy, **speed)

    def _run_batch(self, epoch, step, x, y, stats):
        x = x.to(self.device, non_blocking=True, memory_format=self.layout)
        y = y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        # --accumulate N: N micro-batches add their gradients, then one optimizer step.
        for k, xk, yk, share, _ in common.micro_batches(x, y, self.args.accumulate):
            # Dropout: a different draw on every rank (the one that would take micro-batch k
            # with N times the processes), and the same again after a resume.
            common.seed_step(self.args.seed, epoch, step, self.rank + self.world_size * k)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss = common.loss_fn(self.model(xk), yk)
            self.scaler.scale(loss * share).backward()  # summed onto the first GPU here
            stats.add(loss, len(yk))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr.step()  # not after a step that fp16's scaler skipped

    def _evaluate(self):  # exact: every test sample counted once
        return common.evaluate(self.model.module, self.test_set, self.device, self.loader.batch_size,
                               self.args.workers, self.rank, self.world_size)

    def _save_snapshot(self, epoch, step):
        if self.args.checkpoint:  # the unwrapped model: no "module." prefix
            state = common.checkpoint_state(self.model.module, self.optimizer, self.scheduler,
                                            self.scaler, epoch, step, self.args)
            common.save_checkpoint(state, self.args.checkpoint)


if __name__ == "__main__":
    with common.clean_exit():
        main()
