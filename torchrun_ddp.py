"""DistributedDataParallel on MNIST, processes started by torchrun (elastic).

One machine:   torchrun --standalone --nproc-per-node=2 torchrun_ddp.py
Fault-tolerant: torchrun --standalone --nproc-per-node=2 --max-restarts=3 torchrun_ddp.py \\
                    --checkpoint run/snapshot.pt --save-every 50
Two machines:  torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
                    --rdzv-endpoint=HOST0:29500 --rdzv-id=job1 torchrun_ddp.py   (on each)
Old launcher:  python -m torch.distributed.launch --nproc-per-node=2 torchrun_ddp.py
No launcher:   python torchrun_ddp.py   (one process)

With --checkpoint, the script continues from that file whenever it exists: a group that
torchrun restarts after a failure picks up at the last snapshot instead of starting over.
"""
import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def main():
    parser = common.build_parser(__doc__)
    g = parser.add_argument_group("launch (torchrun)")
    g.add_argument("--local-rank", "--local_rank", type=common.natural_int, default=0,
                   help="passed by python -m torch.distributed.launch; LOCAL_RANK from the "
                   "environment takes precedence")
    args = parser.parse_args()

    # torchrun tells each process who it is through the environment (LOCAL_RANK, RANK,
    # WORLD_SIZE, ...). Without those variables this is a single process.
    gpus = torch.cuda.device_count()
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus and nproc > gpus:  # two processes on one GPU: NCCL refuses, or they fight over it
        raise common.Fatal(f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s)")
    if args.checkpoint and os.path.exists(args.checkpoint):
        args.resume = True  # elastic: a restarted group continues from the last snapshot
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))  # the old launcher: flag
    common.check_args(args, world_size=int(os.environ.get("WORLD_SIZE", 1)), cuda=gpus > 0,
                      say=local_rank == 0)
    # GROUP_RANK: torchrun's index of this machine; its node 0 holds global rank 0.
    common.check_outputs(args, int(os.environ.get("GROUP_RANK", 0)), say=local_rank == 0)
    train(local_rank, nproc, args)


def train(local_rank, nproc, args):
    # Who am I: the global rank counts processes over all nodes, local_rank within this one.
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # 0, then 1 after a restart

    # One GPU per process and NCCL between GPUs; without GPUs, gloo between CPU processes,
    # each with its share of the cores (torchrun sets OMP_NUM_THREADS=1 when it starts several).
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(common.threads_per_process(nproc))

    # Meet the others through the store torchrun's agent hosts (MASTER_ADDR:MASTER_PORT). Keys
    # are prefixed with the restart count: after a restart the store still holds the dead
    # round's addresses, and gloo may try to connect to them (pytorch/pytorch#167288).
    # The timeout makes a missing or dead peer an error within about a minute, not a hang.
    timeout = timedelta(seconds=args.timeout)
    if "RANK" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"restart{restart}/", store)
    else:  # plain `python torchrun_ddp.py`: a group of one, in memory, no port needed
        store = dist.HashStore()
        common.gloo_on_loopback()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout,
                            device_id=device if device.type == "cuda" else None)  # NCCL: this GPU
    report = common.Reporter(args, rank, world_size)
    report.log(f"{world_size} processes ({world_size // nproc} node(s) x {nproc}), backend "
               f"{backend}, device {device.type}, {torch.get_num_threads()} thread(s) each, "
               f"restart {restart} (TORCHELASTIC_RESTART_COUNT)")
    report.log(common.describe_lr(args))
    if local_rank == 0:  # download once per machine, before anyone reads the files
        common.prepare_data(args)
    dist.barrier()

    # Data: every process holds all of MNIST in memory; the sampler gives each a disjoint
    # shard, and each process takes its part of the global batch.
    train_set, test_x, test_y = common.load_mnist(args, device)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = common.batch_loader(train_set, sampler, args.batch_size // world_size)

    # Model: the same seed gives every process the same initial weights (DDP also broadcasts
    # rank 0's at construction). SyncBatchNorm must replace BatchNorm before the DDP wrap.
    common.seed_everything(args.seed)
    model = common.Net().to(device)
    if args.channels_last:  # NHWC weights: faster convolutions (README, Speed). MNIST's
        model = model.to(memory_format=torch.channels_last)  # one channel is NHWC already
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = common.make_optimizer(model, args)
    scheduler = common.make_scheduler(optimizer, args, len(loader))
    amp_dtype = common.AMP_DTYPES[args.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 needs none

    start_epoch, start_step = 0, 0
    if args.resume or args.evaluate:  # every process loads, onto its own device
        ckpt = common.load_checkpoint(args.checkpoint, map_location=device)
        start_epoch, start_step = common.restore(ckpt, model, optimizer, scheduler, scaler,
                                                 args.checkpoint)
        if not common.same_everywhere(start_epoch, start_step, device=device):
            raise common.Fatal(f"the nodes' copies of {args.checkpoint} are at different steps "
                               "(a crash between two writes): copy the newest to every node")
        report.log(f"loaded {args.checkpoint}: {start_epoch} epoch(s) + {start_step} step(s) trained")
    if args.evaluate:
        correct, total = common.evaluate(model, test_x, test_y, rank, world_size)
        report.record(epoch=start_epoch, evaluate=True, **common.accuracy_fields(correct, total))
        dist.destroy_process_group()
        return

    # DDP all-reduces gradients during backward, so every replica takes the same step.
    # device_ids only for CUDA: a CPU module takes None.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # Compile the DDP-wrapped model (DDP notes): graphs split at its buckets, all-reduce overlaps.
    if args.compile:  # .module and .no_sync() pass through to DDP: the saves stay a plain Net
        model = torch.compile(model)
    # One checkpoint writer in all (concurrent writes to a shared disk corrupt the file), or
    # one per node when nodes have no shared filesystem.
    writer = (local_rank if args.save_on_each_node else rank) == 0
    # A scheduler's SIGTERM (the notice before it kills the job) may reach any process at any
    # step: all of them agree on one step to stop at, so the snapshot is the same model.
    # torchrun also sends SIGTERM to its workers when it stops them (after a failure, at a
    # resize, on its own SIGTERM): then too they leave a snapshot at the step they reached.
    stop = common.StopSignal()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch is the same
        model.train()
        loss_sum, seen = torch.zeros((), device=device), 0
        timer = common.Timer(device)
        # Resuming mid-epoch: set_epoch gives the same order as before, so skip what was done.
        skip = start_step if epoch == start_epoch else 0
        for step, (x, y) in enumerate(itertools.islice(loader, skip, None), skip + 1):
            if stop():  # SIGTERM: every process stops before this step, after a snapshot
                if writer and args.checkpoint:
                    state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                                    epoch, step - 1, args)
                    common.save_checkpoint(state, args.checkpoint)
                dist.barrier()  # nobody exits before the snapshot is complete
                raise common.Preempted(args, epoch, step - 1, say=rank == 0)
            optimizer.zero_grad(set_to_none=True)
            scale = scaler.get_scale()
            # --accumulate N: N micro-batches add their gradients, then one optimizer step.
            for xk, yk, share, last in common.micro_batches(x, y, args.accumulate):
                with common.sync_on(last, model):  # no all-reduce before the last micro-batch
                    with torch.autocast(device.type, dtype=amp_dtype,
                                        enabled=amp_dtype is not None):
                        loss = F.cross_entropy(model(xk), yk, label_smoothing=0.1)
                    scaler.scale(loss * share).backward()  # averaged over processes here
                loss_sum += loss.detach() * len(yk)
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale:  # fp16 skips a step with inf/NaN gradients and
                scheduler.step()             # lowers the scale: then keep the LR where it is
            seen += len(y)
            if step % args.log_interval == 0:  # a collective: every process reaches it together
                mean_loss = common.reduce_tensor(loss_sum).item() / seen
                report.progress(epoch, step, len(loader), mean_loss,
                                scheduler.get_last_lr()[0], timer.elapsed(), seen * world_size)
            if writer and args.save_every and step % args.save_every == 0 and step < len(loader):
                state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                                epoch, step, args)  # mid-epoch: no barrier
                common.save_checkpoint(state, args.checkpoint)
        train_loss = common.reduce_tensor(loss_sum).item() / seen  # the mean over all processes
        seconds = timer.elapsed()

        correct, total = common.evaluate(model.module, test_x, test_y, rank, world_size)
        if writer and args.checkpoint:
            state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                            epoch + 1, 0, args)
            common.save_checkpoint(state, args.checkpoint)
        dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is complete
        report.record(epoch=epoch + 1, train_loss=train_loss, **common.accuracy_fields(correct, total),
                      epoch_seconds=seconds, samples_per_s=seen * world_size / seconds,
                      data_wait=loader.wait_seconds / seconds)
        if epoch + 1 == args.stop_after:
            break

    report.close()
    stop.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    with common.clean_exit(f"[rank {os.environ.get('RANK', 0)}] "):
        main()
