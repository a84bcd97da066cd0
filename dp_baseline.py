"""One process: the training that spawn_ddp.py makes data-parallel (README.md).

    python dp_baseline.py [--gpus 0,1]     # every visible GPU (or those given), or the CPU
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler

import common
from ddpkit import checkpoint, data, flags, launch, machine, reporting, sigterm
from ddpkit.task import load_task


def main():
    args = flags.parse_args(__doc__, "dp")
    task = load_task(args.task)  # the task's names: common.py's (MNIST), or --task's
    flags.check_args(args, task)
    task.prepare_data(args)  # download once per machine, before any process reads the data
    train(launch.Place(), args)


def train(place, args):
    task = load_task(args.task)  # the task's names: common.py's (MNIST), or --task's
    rank, world_size = place.rank, place.world_size  # its place in the job (launch.Place)
    device = machine.process_device(args.gpus[0] if args.gpus else 0, 1)  # first GPU, or CPU
    cuda = device.type == "cuda"

    # Data: this process's part of each global batch, from its sampler; augmentation per sample.
    train_set, test_set = task.make_datasets(args)
    train_set = data.PerSampleSeeds(train_set, args.seed)
    sampler = RandomSampler(train_set, generator=torch.Generator())  # seeded at each epoch
    batch_size = args.batch_size // world_size
    loader = DataLoader(train_set, batch_size, sampler=data.Skippable(sampler),
                        num_workers=args.workers, collate_fn=task.collate, pin_memory=cuda,
                        drop_last=data.drop_last(len(sampler), batch_size, args.accumulate),
                        **data.worker_options(args.workers))
    # Evaluation: each process takes its share of the test set, every sample counted once.
    test_loader = DataLoader(test_set, batch_size, sampler=range(rank, len(test_set), world_size),
                             num_workers=args.workers, collate_fn=task.collate, pin_memory=cuda,
                             **data.worker_options(args.workers))
    data.start_workers(loader, test_loader)
    report = reporting.Reporter(args, place, device)

    # Model, optimizer and schedule from --seed; with --resume, continued from --checkpoint.
    torch.manual_seed(args.seed)
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = task.make_model(args).to(device, memory_format=layout)
    common.evaluate(model, test_loader, device, task, batches=1)  # a misfit fails here, not later
    optimizer = task.make_optimizer(model, args)
    steps = len(loader)  # per epoch
    scheduler = task.make_scheduler(optimizer, args, steps)
    wish = checkpoint.RESUME if args.resume or args.evaluate else checkpoint.NO_RESUME
    ckpt = checkpoint.agreed(args, wish, place, device, report.log)  # and --amp auto's dtype
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 needs none
    epoch, step = checkpoint.restore(ckpt, model, optimizer, scheduler, scaler,
                                     args.checkpoint, report.log)
    report.start(epoch, step, steps, optimizer)  # the LR line; --tensorboard goes on from here
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    net = nn.DataParallel(machine.Autocast(model, amp), args.gpus) if cuda else model  # replicas

    def save(epoch, step):  # by one writer; the plain model's state: no "module." prefix
        if args.checkpoint:
            checkpoint.save(checkpoint.state(
                model, optimizer, scheduler, scaler, epoch, step, args), args.checkpoint)

    if args.evaluate:  # the model in --checkpoint, on the test set, and nothing else
        metrics = common.evaluate(model, test_loader, device, task)
        report.record(epoch=epoch, evaluate=True, **metrics)
    stop = sigterm.StopSignal(args.checkpoint, device, steps)  # SIGTERM: stop, and save
    scale = scaler.get_scale()
    for epoch in range(epoch, epoch if args.evaluate else args.epochs):
        sampler.generator.manual_seed(args.seed + epoch)  # a new order each epoch
        train_set.set_epoch(epoch)  # and new augmentation
        loader.sampler.skip = step * batch_size  # resuming mid-epoch: skip what was trained
        model.train()
        stats = reporting.EpochStats(device, skipped=step, steps=steps)  # resumed: says partial
        for step, (inputs, target) in enumerate(stats.timed(loader), step + 1):
            if stop(step):  # SIGTERM: stop before this step, after a snapshot
                save(epoch, step - 1)
                raise stop.stopped(args.checkpoint, epoch, step - 1)
            inputs = common.to_device(inputs, device, args.channels_last)
            target = target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            # --accumulate N: N micro-batches add up their gradients, then one optimizer step.
            for k, (x, y, share, last) in enumerate(
                    data.micro_batches(inputs, target, args.accumulate)):
                data.seed_step(args.seed, epoch, step, rank + world_size * k, args.gpus)
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss = task.loss_fn(common.forward(net, x), y)
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
        metrics = common.evaluate(model, test_loader, device, task)
        save(epoch + 1, 0)
        report.record(epoch=epoch + 1, train_loss=train_loss, **metrics, **speed)
        step = 0
        if epoch + 1 == args.stop_after:  # this run ends here; a later one continues
            break
    stop.close()


if __name__ == "__main__":
    with launch.clean_exit():
        main()
