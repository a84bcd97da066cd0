"""nn.DataParallel on MNIST: the single-process baseline that DDP replaced.

One process drives every visible GPU (or those in --gpus): each step it copies the model to
every GPU, splits the batch across them, runs the replicas in threads, gathers the outputs on
the first GPU and sums the gradients back there. Without a GPU it is a plain trainer.

    python dp_baseline.py                 # all visible GPUs
    python dp_baseline.py --gpus 0,1
"""
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

import common


def main():
    parser = common.build_parser(__doc__, processes=False)  # no --timeout, --save-on-each-node
    g = parser.add_argument_group("launch (DataParallel)")
    g.add_argument("--gpus", help="comma-separated GPU ids, the first gathers (default: all)")
    args = parser.parse_args()

    count = torch.cuda.device_count()
    try:
        gpus = [int(i) for i in args.gpus.split(",")] if args.gpus else list(range(count))
    except ValueError:
        raise common.Fatal(f"--gpus {args.gpus!r}: expected comma-separated GPU ids like 0,1") from None
    if any(not 0 <= i < count for i in gpus):
        raise common.Fatal(f"--gpus {args.gpus}: this machine has {count} GPU(s)")
    if args.sync_bn:  # SyncBatchNorm needs a process group, which DataParallel does not have
        raise common.Fatal("--sync-bn needs the DDP scripts (spawn_ddp.py); DataParallel has no "
                           "process group")
    common.check_args(args, world_size=1, cuda=bool(gpus))
    common.check_outputs(args)  # before any work that could be lost
    common.prepare_data(args)
    train(gpus, args)


def train(gpus, args):
    # One process. Inputs go to the first GPU; DataParallel scatters them from there.
    report = common.Reporter(args, rank=0, world_size=1)
    if gpus:
        device = torch.device("cuda", gpus[0])
        torch.cuda.set_device(device)
        report.log(f"DataParallel over GPU(s) {gpus}, gathering on cuda:{gpus[0]}")
    else:
        device = torch.device("cpu")
        report.log(f"no GPU: one process, {torch.get_num_threads()} thread(s) "
                   "(DataParallel passes every call through to the model)")
    report.log(common.describe_lr(args))

    # Data: the whole global batch is loaded by this one process. A DistributedSampler over a
    # single replica is a seeded shuffle: it gives the same order as the DDP scripts.
    train_set, test_x, test_y = common.load_mnist(args, device)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
    loader = common.batch_loader(train_set, sampler, args.batch_size)

    common.seed_everything(args.seed)
    model = common.Net().to(device)
    if args.channels_last:  # NHWC weights: faster convolutions (README, Speed). MNIST's
        model = model.to(memory_format=torch.channels_last)  # one channel is NHWC already
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args, len(loader))
    amp_dtype = common.AMP_DTYPES[args.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 needs none

    start_epoch, start_step = 0, 0
    if args.resume or args.evaluate:  # any script's checkpoint: none has a "module." prefix
        ckpt = common.load_checkpoint(args.checkpoint, map_location=device)
        start_epoch, start_step = common.restore(ckpt, model, optimizer, scheduler, scaler,
                                                 args.checkpoint)
        report.log(f"loaded {args.checkpoint}: {start_epoch} epoch(s) + {start_step} step(s) trained")
    if args.evaluate:
        correct, total = common.evaluate(model, test_x, test_y)
        report.record(epoch=start_epoch, evaluate=True, **common.accuracy_fields(correct, total))
        return

    # Replicated on every step, in this process; the gradients end up on the first GPU.
    # torch.autocast's state reaches DataParallel's worker threads (torch >= 1.10).
    model = nn.DataParallel(model, device_ids=gpus or None)
    if args.compile:  # .module passes through to DataParallel's: saves stay a plain Net
        model = torch.compile(model)
    stop = common.StopSignal()  # a scheduler's SIGTERM: stop at the next step, with a snapshot

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        model.train()
        loss_sum, seen = torch.zeros((), device=device), 0
        timer = common.Timer(device)
        # Resuming mid-epoch: set_epoch gives the same order as before, so skip what was done.
        skip = start_step if epoch == start_epoch else 0
        for step, (x, y) in enumerate(itertools.islice(loader, skip, None), skip + 1):
            if stop():  # SIGTERM: stop before this step, after a snapshot
                if args.checkpoint:
                    state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                                    epoch, step - 1, args)
                    common.save_checkpoint(state, args.checkpoint)
                raise common.Preempted(args, epoch, step - 1, say=True)
            optimizer.zero_grad(set_to_none=True)
            scale = scaler.get_scale()
            # --accumulate N: N micro-batches add their gradients, then one optimizer step.
            for xk, yk, share, _ in common.micro_batches(x, y, args.accumulate):
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(xk), yk, label_smoothing=0.1)
                scaler.scale(loss * share).backward()  # summed onto the first GPU here
                loss_sum += loss.detach() * len(yk)
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale:  # fp16 skips a step with inf/NaN gradients and
                scheduler.step()             # lowers the scale: then keep the LR where it is
            seen += len(y)
            if step % args.log_interval == 0:
                mean_loss = loss_sum.item() / seen
                report.progress(epoch, step, len(loader), mean_loss,
                                scheduler.get_last_lr()[0], timer.elapsed(), seen)
            if args.save_every and step % args.save_every == 0 and step < len(loader):
                state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                                epoch, step, args)
                common.save_checkpoint(state, args.checkpoint)
        train_loss = loss_sum.item() / seen
        seconds = timer.elapsed()

        correct, total = common.evaluate(model.module, test_x, test_y)
        if args.checkpoint:  # the unwrapped model: no "module." prefix in the file
            state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                            epoch + 1, 0, args)
            common.save_checkpoint(state, args.checkpoint)
        report.record(epoch=epoch + 1, train_loss=train_loss, **common.accuracy_fields(correct, total),
                      epoch_seconds=seconds, samples_per_s=seen / seconds,
                      data_wait=loader.wait_seconds / seconds)
        if epoch + 1 == args.stop_after:
            break

    report.close()
    stop.close()


if __name__ == "__main__":
    with common.clean_exit():
        main()
