"""One process: the training that spawn_ddp.py makes data-parallel (README.md).

    python dp_baseline.py [--gpus 0,1]     # every visible GPU (or those given), or the CPU
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler

import common
import harness
import resumable


def main():
    args = harness.parse_args(__doc__, "dp")
    harness.check_args(args)
    common.prepare_data(args)  # download once per machine, before any process reads the data
    train(args)


def train(args):
    rank, world_size = 0, 1  # one process (spawn_ddp.py: several)
    device = harness.process_device(args.gpus[0] if args.gpus else 0, 1)  # first GPU, or CPU
    cuda = device.type == "cuda"

    # Data: this process's part of each global batch, from its sampler; augmentation per sample.
    train_set, test_set = common.make_datasets(args)
    train_set = resumable.PerSampleSeeds(train_set, args.seed)
    sampler = RandomSampler(train_set, generator=torch.Generator())  # seeded at each epoch
    batch_size = args.batch_size // world_size
    loader = DataLoader(train_set, batch_size, sampler=resumable.Skippable(sampler),
                        num_workers=args.workers, collate_fn=common.collate, pin_memory=cuda,
                        **resumable.worker_options(args.workers))
    # Evaluation: each process takes its share of the test set, every sample counted once.
    test_loader = DataLoader(test_set, batch_size,
                             num_workers=args.workers, collate_fn=common.collate, pin_memory=cuda,
                             **resumable.worker_options(args.workers))
    resumable.start_workers(loader, test_loader)
    report = harness.Reporter(args, rank, world_size, device)

    # Model, optimizer and schedule from --seed; with --resume, continued from --checkpoint.
    torch.manual_seed(args.seed)
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = common.make_model(args).to(device, memory_format=layout)
    harness.check_task(model, loader, test_loader, device, world_size, args.channels_last)
    optimizer = common.make_optimizer(model, args)
    steps = len(loader)  # per epoch
    scheduler = common.make_scheduler(optimizer, args, steps)
    wish = resumable.RESUME if args.resume or args.evaluate else resumable.NO_RESUME
    ckpt = resumable.agreed_checkpoint(args, wish, device, report.log)  # refuses another run's
    harness.settle_precision(args, ckpt, device, report.log)  # --amp auto: one for the whole job
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 needs none
    epoch, step = resumable.restore(ckpt, model, optimizer, scheduler, scaler, args.checkpoint,
                                    report.log)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    net = nn.DataParallel(harness.Autocast(model, amp), args.gpus) if cuda else model  # replicas

    def save(epoch, step):  # the plain model's state: no "module." prefix
        if args.checkpoint:
            common.save_checkpoint(common.checkpoint_state(
                model, optimizer, scheduler, scaler, epoch, step, args), args.checkpoint)

    if args.evaluate:  # the model in --checkpoint, on the test set, and nothing else
        report.record(epoch=epoch, evaluate=True, **common.evaluate(model, test_loader, device))
    stop = resumable.StopSignal(args.checkpoint, device, steps)  # SIGTERM: stop, and save
    scale = scaler.get_scale()
    for epoch in range(epoch, epoch if args.evaluate else args.epochs):
        sampler.generator.manual_seed(args.seed + epoch)  # a new order each epoch
        train_set.set_epoch(epoch)  # and new augmentation
        loader.sampler.skip = step * batch_size  # resuming mid-epoch: skip what was trained
        model.train()
        stats = harness.EpochStats(device, skipped=step, steps=steps)  # resumed: says partial
        for step, (inputs, target) in enumerate(stats.timed(loader), step + 1):
            if stop(step):  # SIGTERM: stop before this step, after a snapshot
                save(epoch, step - 1)
                raise stop.stopped(args.checkpoint, epoch, step - 1)
            inputs = common.to_device(inputs, device, args.channels_last)
            target = target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            # --accumulate N: N micro-batches add up their gradients, then one optimizer step.
            for k, (x, y, share, last) in enumerate(
                    resumable.micro_batches(inputs, target, args.accumulate)):
                resumable.seed_step(args.seed, epoch, step, rank + world_size * k, args.gpus)
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss = common.loss_fn(common.forward(net, x), y)
                scaler.scale(loss * share).backward()
                stats.add(loss, len(y))
            scaler.step(optimizer)  # with fp16, skipped when a gradient overflowed
            scaler.update()
            scale, before = scaler.get_scale(), scale  # with fp16, one sync a step
            if scale >= before:  # so the schedule waits for a step the scaler skipped
                scheduler.step()
            if step % args.log_interval == 0:
                loss = stats.loss_sum.item() / stats.seen
                report.progress(epoch, step, steps, loss, scheduler.get_last_lr()[0], stats)
            if args.save_every and step % args.save_every == 0 and step < steps:
                save(epoch, step)
        train_loss = stats.loss_sum.item() / stats.seen
        speed = stats.speed(world_size)  # the epoch's, before the evaluation
        metrics = common.evaluate(model, test_loader, device)
        save(epoch + 1, 0)
        report.record(epoch=epoch + 1, train_loss=train_loss, **metrics, **speed)
        step = 0
        if epoch + 1 == args.stop_after:  # this run ends here; a later one continues
            break
    stop.close()


if __name__ == "__main__":
    with harness.clean_exit():
        main()
