"""NVIDIA apex: apex.amp mixed precision, apex's DistributedDataParallel and SyncBN, with the
native PyTorch equivalent beside every apex line. Launched like torchrun_ddp.py:

    torchrun --standalone --nproc-per-node=2 apex_ddp.py --opt-level O1
    python -m torch.distributed.launch --nproc-per-node=2 apex_ddp.py

Where apex imports (a source build of release 25.05 or older: later releases removed apex.amp
and apex.parallel) and CUDA is present, it trains the apex way. Otherwise, or with --native, it
runs torchrun_ddp.py's training, the same steps with torch.autocast, torch.amp.GradScaler,
nn.SyncBatchNorm and DistributedDataParallel. It says at start which one it took, and why.
"""
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common
from ddpkit import checkpoint, data, flags, launch, machine, reporting, sigterm
from ddpkit.task import load_task
import torchrun_ddp

try:  # NOT `pip install apex`: that is an unrelated web package (docs/apex.md)
    import apex
    from apex import amp
    from apex.parallel import DistributedDataParallel as ApexDDP, convert_syncbn_model
    # Built without its CUDA extension, apex falls back to a Python SyncBatchNorm that returns
    # float32, which O2 and O3's half convolutions refuse: torch's nn.SyncBatchNorm then.
    apex_syncbn = not hasattr(apex.parallel.SyncBatchNorm, "syncbn_import_error")
    apex_problem = None
except Exception as e:  # missing, the wrong package, or a release without amp/parallel
    apex, apex_problem = None, f"{type(e).__name__}: {e}"


def main(place):
    args = flags.parse_args(__doc__, "apex")
    if args.amp != "auto":
        raise common.Fatal("apex_ddp.py sets the precision with --opt-level, not --amp")
    gpus = torch.cuda.device_count()
    standin = getattr(apex, "STAND_IN", False)  # tests/standin runs apex's calls on CPU
    if args.native:
        use_apex, why = False, "native PyTorch (--native)"
    elif apex is None:
        use_apex, why = False, f"native PyTorch: apex does not import ({apex_problem})"
    elif not (gpus or standin):
        use_apex, why = False, "native PyTorch: apex needs CUDA and there is no GPU"
    else:
        use_apex, why = True, f"apex ({apex.__file__}), amp opt level {args.opt_level}"
        if args.sync_bn and not apex_syncbn:
            why += "; --sync-bn: torch's nn.SyncBatchNorm, as apex has no syncbn extension " \
                   "(built without --cuda_ext) and its Python SyncBatchNorm breaks O2 and O3"
    if use_apex and args.compile:  # amp patches torch functions at run time: never tried here
        raise common.Fatal("--compile is untested with apex's amp and DDP; add --native")
    if use_apex and args.find_unused_parameters:  # apex's DDP has no such option
        raise common.Fatal("--find-unused-parameters is DDP's: add --native")
    # The opt level decides. Natively O0 is fp32 and O1-O3 autocast: float16 with a GradScaler
    # on GPUs; on CPUs --amp auto's rule, bfloat16 if every CPU of the job computes it, else
    # fp32 (faster there), decided by the job together and said.
    args.amp = "none"
    if not use_apex and args.opt_level != "O0":
        args.amp = "fp16" if gpus else "auto"
    if not use_apex:
        why += f"; opt level {args.opt_level} -> " + {
            "none": "fp32", "auto": "autocast bfloat16 where every CPU of the job computes it, "
            "else fp32", "fp16": "autocast float16 + GradScaler"}[args.amp]
    flags.check_args(args, load_task(args.task), place, elastic=True,
                     cuda=gpus > 0 or (use_apex and standin))
    if not use_apex:
        if place.rank == 0:
            print(f"path: {why}", flush=True)
        return torchrun_ddp.train(place, args)
    train(place, args, why)


def train(place, args, why):
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
    report.log(f"path: {why}")

    # Model, optimizer and schedule from --seed; with --resume, continued from --checkpoint.
    torch.manual_seed(args.seed)
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = task.make_model(args).to(device, memory_format=layout)
    # apex's order: model on the GPU, convert_syncbn_model, the optimizer, amp.initialize,
    # then (after any checkpoint is loaded) the DDP wrap.
    if args.sync_bn:  # native: nn.SyncBatchNorm.convert_sync_batchnorm
        model = convert_syncbn_model(model) if apex_syncbn else \
            nn.SyncBatchNorm.convert_sync_batchnorm(model)
    common.evaluate(model, test_loader, device, task, batches=1)  # a misfit fails here, not later
    optimizer = task.make_optimizer(model, args)
    # native: torch.autocast around the forward, and a GradScaler for float16.
    # O1 patches torch functions to cast per op; O2 keeps fp32 master weights.
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    steps = len(loader)  # per epoch
    scheduler = task.make_scheduler(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # amp keeps the loss scale
    # Elastic: a group that torchrun (re)starts continues from the snapshot, if any has one.
    wish = checkpoint.RESUME if args.resume or args.evaluate else checkpoint.RESUME_IF_FOUND
    ckpt = checkpoint.agreed(args, wish, place, device, report.log)  # and the precision
    if ckpt and "amp" in ckpt:  # after amp.initialize, as apex documents
        amp.load_state_dict(ckpt["amp"])
    epoch, step = checkpoint.restore(ckpt, model, optimizer, scheduler, scaler,
                                     args.checkpoint, report.log)
    report.start(epoch, step, steps, optimizer)  # the LR line; --tensorboard goes on from here
    # native: DDP(model, device_ids=[local_rank]). delay_allreduce=True: one all-reduce, after
    # the whole backward pass.
    ddp = ApexDDP(model, delay_allreduce=True)

    def save(epoch, step):  # by one writer; the plain model's state: no "module." prefix
        launch.set_timeout(args, steady=False)  # --timeout: a write takes what it takes
        if args.checkpoint and (place.local_rank if args.save_on_each_node else rank) == 0:
            state = checkpoint.state(model, optimizer, scheduler, scaler, epoch, step, args)
            state["amp"] = amp.state_dict()  # the loss scale (native: the scaler's state)
            checkpoint.save(state, args.checkpoint)
        dist.barrier()  # nobody runs ahead, or exits, before the checkpoint is complete

    if args.evaluate:  # the model in --checkpoint, on the test set, and nothing else
        metrics = common.evaluate(model, test_loader, device, task)
        report.record(epoch=epoch, evaluate=True, **metrics)
    stop = sigterm.StopSignal(args.checkpoint, device, steps, elastic=True)  # SIGTERM: save
    scale = loss_scale()
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
            inputs = common.to_device(inputs, device, args.channels_last)
            target = target.to(device, non_blocking=True)
            optimizer.zero_grad()  # no set_to_none=: apex O2 patches it without arguments
            # --accumulate N: N micro-batches add up their gradients, then one optimizer step.
            for k, (x, y, share, last) in enumerate(
                    data.micro_batches(inputs, target, args.accumulate)):
                data.seed_step(args.seed, epoch, step, rank + world_size * k)  # dropout
                if not last:  # native: DDP's no_sync(); apex's DDP has none
                    ddp.disable_allreduce()
                loss = task.loss_fn(common.forward(ddp, x), y)  # native: under torch.autocast
                # native: scaler.scale(loss).backward(). delay_unscale leaves the earlier
                # micro-batches' gradients in .grad for the all-reduce of the last one (else amp
                # moves them aside before each backward and adds them back, never all-reduced).
                with amp.scale_loss(loss * share, optimizer, delay_unscale=not last) as scaled:
                    scaled.backward()  # apex's DDP all-reduces the gradients here, on the last
                ddp.enable_allreduce()
                stats.add(loss, len(y))
            optimizer.step()  # native: scaler.step(optimizer); amp skips it after an overflow
            scale, before = loss_scale(), scale  # apex lowers it when it skipped a step: the
            if scale >= before:  # schedule waits for that step, as with the native GradScaler
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


def loss_scale():
    return amp.state_dict()["loss_scaler0"]["loss_scale"]


if __name__ == "__main__":
    place = launch.torchrun_place()  # who this process is, from its launcher's environment
    with launch.clean_exit(place):
        main(place)
