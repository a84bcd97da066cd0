"""FSDP2 (fully_shard): torchrun_ddp.py for a model that outgrows DDP, each process holding
about 1/N of the weights, gradients and optimizer state (docs/fsdp.md). torch 2.7 or later
(2.6 on GPUs).

One machine:   torchrun --standalone --nproc-per-node=2 torchrun_fsdp.py
Fault-tolerant: torchrun --standalone --nproc-per-node=2 --max-restarts=3 torchrun_fsdp.py \\
                    --checkpoint run/snapshot --save-every 50
Two machines:  torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
                    --rdzv-endpoint=HOST0:29500 --rdzv-id=job1 torchrun_fsdp.py   (on each)
No launcher:   python torchrun_fsdp.py   (one process)

--checkpoint is a folder of torch.distributed.checkpoint (DCP) that every process writes its
shards to; the script continues from it whenever it finds it, as torchrun_ddp.py does.
"""
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

try:  # torch 2.6 on; check_args says which torch this machine needs
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
except ImportError:
    pass

import common
from ddpkit import checkpoint, data, flags, launch, machine, reporting, sigterm
from ddpkit.task import load_task, same_weights


def main(place):
    args = flags.parse_args(__doc__, "fsdp")
    flags.check_args(args, load_task(args.task), place, elastic=True, sharded=True)
    train(place, args)


def train(place, args):
    task = load_task(args.task)  # the task's names: common.py's (MNIST), or --task's
    rank, world_size = place.rank, place.world_size  # as torchrun says (launch.torchrun_place)
    device = machine.process_device(place.local_rank, place.nproc)  # its GPU, or CPU cores
    cuda = device.type == "cuda"
    # torchrun's environment is all init_process_group needs; torchrun_store adds a meeting
    store = launch.torchrun_store(args, place, device)

    # Data: this process's part of each global batch, from its sampler; augmentation per sample.
    # Loaded by all before any joins the group: one that fails ends the others (load_data).
    train_set, test_set = launch.load_data(store, place, args, task)
    train_set = data.PerSampleSeeds(train_set, args.seed)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)  # its own shard
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
    # Join the process group: every collective (all-reduce, barrier) runs among its processes.
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)  # bound to its own GPU
    report = reporting.Reporter(args, place, device)

    # Model, optimizer and schedule from --seed; with --resume, continued from --checkpoint.
    torch.manual_seed(args.seed)  # the same weights in every process: FSDP broadcasts none
    model = task.make_model(args)  # whole in host memory; only each process's shard goes on
    same_weights(model, device)  # one all-gather of a checksum: a patchwork is refused here
    if args.sync_bn:  # BatchNorm statistics over the global batch; converted before it runs
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # Elastic: a group that torchrun (re)starts continues from the snapshot, if any has one.
    wish = checkpoint.RESUME if args.resume or args.evaluate else checkpoint.RESUME_IF_FOUND
    ckpt = checkpoint.agreed(args, wish, place, device, report.log)  # and --amp auto's dtype
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    # FSDP2: each unit's weights are split across the processes, gathered whole for its forward
    # and backward only; its gradients are reduce-scattered, each process keeping its shard's.
    # With --amp, gathered and computed in that dtype, gradients reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms and amp is not None:  # BatchNorm computes with fp32 weights, as under autocast (a
        fully_shard(norms)  # CPU's refuses bf16 beside fp32 statistics): one unit for them all
    for unit in task.fsdp_units(model):  # the task's units; MNIST's: each child with weights
        if not isinstance(unit, FSDPModule):  # (a BatchNorm child: a unit already)
            fully_shard(unit, mp_policy=policy)
    root = MixedPrecisionPolicy(amp, torch.float32, output_dtype=torch.float32)  # a fp32 loss
    fully_shard(model, mp_policy=root)  # the root: the weights that no unit holds
    common.evaluate(model, test_loader, device, task, batches=1)  # a misfit fails here, not later
    optimizer = task.make_optimizer(model, args)  # over the shards: 1/N of its state each
    steps = len(loader)  # per epoch
    scheduler = task.make_scheduler(optimizer, args, steps)
    scaler = ShardedGradScaler(device.type, enabled=args.amp == "fp16")  # overflow in any shard
    epoch, step = checkpoint.restore(ckpt, model, optimizer, scheduler, scaler,
                                     args.checkpoint, report.log)
    report.start(epoch, step, steps, optimizer)  # the LR line; --tensorboard goes on from here
    net = torch.compile(model) if args.compile else model

    def save(epoch, step):  # every process writes its shards (checkpoint.save_sharded)
        launch.set_timeout(args, steady=False)  # --timeout: a write takes what it takes
        if args.checkpoint:
            checkpoint.save_sharded(model, optimizer, scheduler, scaler, epoch, step, args)

    if args.evaluate:  # the model in --checkpoint, on the test set, and nothing else
        metrics = common.evaluate(model, test_loader, device, task)
        report.record(epoch=epoch, evaluate=True, **metrics)
    stop = sigterm.StopSignal(args.checkpoint, device, steps, elastic=True)  # SIGTERM: save
    scale = scaler.get_scale()
    for epoch in range(epoch, epoch if args.evaluate else args.epochs):
        sampler.set_epoch(epoch)  # a new order each epoch
        train_set.set_epoch(epoch)  # and new augmentation
        loader.sampler.skip = step * batch_size  # resuming mid-epoch: skip what was trained
        model.train()
        stats = reporting.EpochStats(device, skipped=step, steps=steps)  # resumed: says partial
        for step, (inputs, target) in enumerate(stats.timed(loader), step + 1):
            if stop(step):  # SIGTERM: stop before this step, after a snapshot
                save(epoch, step - 1)
                raise stop.stopped(args.checkpoint, epoch, step - 1)
            inputs = common.to_device(inputs, device, args.channels_last)  # (not the model's)
            target = target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            # --accumulate N: N micro-batches add up their gradients, then one optimizer step.
            for k, (x, y, share, last) in enumerate(
                    data.micro_batches(inputs, target, args.accumulate)):
                data.seed_step(args.seed, epoch, step, rank + world_size * k)  # dropout
                model.set_requires_gradient_sync(last)  # one reduce-scatter, in the last
                loss = task.loss_fn(common.forward(net, x), y)  # the output in fp32
                scaler.scale(loss * share).backward()  # FSDP reduce-scatters the gradients here
                stats.add(loss, len(y))
            scaler.step(optimizer)  # with fp16, skipped when a gradient overflowed
            scaler.update()
            scale, before = scaler.get_scale(), scale  # with fp16, one sync a step
            if scale >= before:  # so the schedule waits for a step the scaler skipped
                scheduler.step()
            launch.set_timeout(args, step > stats.skipped + 1)  # all past their 1st step: short
            if step % args.log_interval == 0:
                loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen  # all processes'
                report.progress(epoch, step, steps, loss, scheduler.get_last_lr()[0], stats)
            if args.save_every and step % args.save_every == 0 and step < steps:
                save(epoch, step)
        train_loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen
        speed = stats.speed(world_size)  # the epoch's, before the evaluation
        metrics = common.evaluate(model, test_loader, device, task)
        save(epoch + 1, 0)
        report.record(epoch=epoch + 1, train_loss=train_loss, **metrics, **speed)
        step = 0
        if epoch + 1 == args.stop_after:  # this run ends here; a later one continues
            break
    stop.close()
    dist.destroy_process_group()  # frees the group's threads and sockets


if __name__ == "__main__":
    place = launch.torchrun_place()  # who this process is, from its launcher's environment
    with launch.clean_exit(place):
        main(place)
