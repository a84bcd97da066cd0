"""DistributedDataParallel, processes started by torch.multiprocessing.spawn (README.md).

    python spawn_ddp.py --nproc-per-node 2     # one machine; several: docs/clusters.md
"""
import tempfile
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common
import harness
import resumable


def main():
    args = harness.parse_args(__doc__, "spawn")
    harness.check_args(args)
    common.prepare_data(args)  # download once per machine, before any process reads the data
    with tempfile.TemporaryDirectory() as private:  # on one machine they meet in a file here
        workers = mp.spawn(harness.worker, (train, args, private), args.nproc_per_node, join=False)
        harness.join(workers)  # each a new interpreter, running train(local_rank, args, ...)


def train(local_rank, args, store_file):
    nproc = args.nproc_per_node  # processes on this machine, local_rank the index among them
    rank, world_size = args.node_rank * nproc + local_rank, args.nnodes * nproc  # of all nodes
    device = harness.process_device(local_rank, nproc)  # its own GPU, or its share of the cores
    cuda = device.type == "cuda"

    # Data: this process's part of each global batch, from its sampler; augmentation per sample.
    train_set, test_set = common.make_datasets(args)
    train_set = resumable.PerSampleSeeds(train_set, args.seed)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)  # its own shard
    batch_size = args.batch_size // world_size
    loader = DataLoader(train_set, batch_size, sampler=resumable.Skippable(sampler),
                        num_workers=args.workers, collate_fn=common.collate, pin_memory=cuda,
                        **resumable.worker_options(args.workers))
    # Evaluation: each process takes its share of the test set, every sample counted once.
    test_loader = DataLoader(test_set, batch_size, sampler=range(rank, len(test_set), world_size),
                             num_workers=args.workers, collate_fn=common.collate, pin_memory=cuda,
                             **resumable.worker_options(args.workers))
    resumable.start_workers(loader, test_loader)
    # Join the process group: every collective (all-reduce, barrier) runs among its processes.
    store = harness.spawn_store(args, store_file, rank, device)  # a FileStore (nodes: TCP)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)  # bound to its own GPU
    report = harness.Reporter(args, rank, world_size, device)

    # Model, optimizer and schedule from --seed; with --resume, continued from --checkpoint.
    torch.manual_seed(args.seed)
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = common.make_model(args).to(device, memory_format=layout)
    if args.sync_bn:  # BatchNorm statistics over the global batch; converted before it runs
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
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
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)  # gradients averaged in backward
    net = torch.compile(ddp) if args.compile else ddp  # compiled after the wrap, as documented

    def save(epoch, step):  # the plain model's state: no "module." prefix
        if args.checkpoint and (local_rank if args.save_on_each_node else rank) == 0:  # 1 writer
            common.save_checkpoint(common.checkpoint_state(
                model, optimizer, scheduler, scaler, epoch, step, args), args.checkpoint)
        dist.barrier()  # nobody runs ahead, or exits, before the checkpoint is complete

    if args.evaluate:  # the model in --checkpoint, on the test set, and nothing else
        report.record(epoch=epoch, evaluate=True, **common.evaluate(model, test_loader, device))
    stop = resumable.StopSignal(args.checkpoint, device, steps)  # SIGTERM: stop, and save
    scale = scaler.get_scale()
    for epoch in range(epoch, epoch if args.evaluate else args.epochs):
        sampler.set_epoch(epoch)  # a new order each epoch
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
                resumable.seed_step(args.seed, epoch, step, rank + world_size * k)  # dropout
                with nullcontext() if last else ddp.no_sync():  # one all-reduce, in the last
                    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                        loss = common.loss_fn(common.forward(net, x), y)
                    scaler.scale(loss * share).backward()  # DDP all-reduces the gradients here
                stats.add(loss, len(y))
            scaler.step(optimizer)  # with fp16, skipped when a gradient overflowed
            scaler.update()
            scale, before = scaler.get_scale(), scale  # with fp16, one sync a step
            if scale >= before:  # so the schedule waits for a step the scaler skipped
                scheduler.step()
            if step % args.log_interval == 0:
                loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen  # all processes'
                report.progress(epoch, step, steps, loss, scheduler.get_last_lr()[0], stats)
            if args.save_every and step % args.save_every == 0 and step < steps:
                save(epoch, step)
        train_loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen
        speed = stats.speed(world_size)  # the epoch's, before the evaluation
        metrics = common.evaluate(model, test_loader, device)
        save(epoch + 1, 0)
        report.record(epoch=epoch + 1, train_loss=train_loss, **metrics, **speed)
        step = 0
        if epoch + 1 == args.stop_after:  # this run ends here; a later one continues
            break
    stop.close()
    dist.destroy_process_group()  # frees the group's threads and sockets


if __name__ == "__main__":
    with harness.clean_exit():
        main()
