"""DistributedDataParallel on MNIST, processes started by torch.multiprocessing.spawn.

One machine:   python spawn_ddp.py --nproc-per-node 2
Two machines:  python spawn_ddp.py --nnodes 2 --node-rank 0 --master-addr HOST0 --master-port 29500
               python spawn_ddp.py --nnodes 2 --node-rank 1 --master-addr HOST0 --master-port 29500
"""
import itertools
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def main():
    parser = common.build_parser(__doc__)
    g = parser.add_argument_group("launch (spawn)")
    g.add_argument("--nproc-per-node", type=common.positive_int, help="processes on this "
                   "machine (default: one per GPU, or 2 without a GPU)")
    g.add_argument("--nnodes", type=common.positive_int, default=1, help="machines in the job "
                   "(default: 1)")
    g.add_argument("--node-rank", type=common.natural_int, default=0, help="this machine's "
                   "index, 0..nnodes-1")
    g.add_argument("--master-addr", help="address of node 0, reachable from every node "
                   "(default on one machine: 127.0.0.1)")
    g.add_argument("--master-port", type=common.port_number, help="free port on node 0 "
                   "(default on one machine: any free port)")
    args = parser.parse_args()

    gpus = torch.cuda.device_count()
    nproc = args.nproc_per_node or gpus or 2
    if gpus and nproc > gpus:  # two processes on one GPU: NCCL refuses, or they fight over it
        raise common.Fatal(f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s)")
    if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        raise common.Fatal("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if not 0 <= args.node_rank < args.nnodes:
        raise common.Fatal(f"--node-rank must be in 0..{args.nnodes - 1}")
    common.check_args(args, world_size=args.nnodes * nproc, cuda=gpus > 0)
    common.check_outputs(args, node_rank=args.node_rank)  # before any work that could be lost
    args.master_addr = args.master_addr or "127.0.0.1"
    if args.master_port is None:
        args.master_port = common.free_port()
    elif args.node_rank == 0:  # node 0 hosts the rendezvous store on this port
        common.check_port_free(args.master_port)
    common.prepare_data(args)  # download once, here, before any worker exists
    if args.nnodes == 1:
        common.gloo_on_loopback()  # every process is on this machine

    # Start nproc copies of worker(local_rank, ...). spawn (not fork) gives each a fresh
    # interpreter, which CUDA requires. join=False so that Ctrl-C can stop them all.
    workers = mp.spawn(worker, args=(nproc, args), nprocs=nproc, join=False)
    # A SIGTERM to this launcher alone (`kill PID`) goes on to the workers: they save and stop.
    signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in workers.processes])
    try:
        while not workers.join():
            pass
    except mp.ProcessExitedException as e:  # the worker has already printed its reason
        if e.exit_code == common.PREEMPTED:
            raise common.Preempted() from None
        raise common.Failed(f"worker {e.error_index} exited with code {e.exit_code}") from None
    finally:
        for p in workers.processes:
            if p.is_alive():
                p.terminate()


def worker(local_rank, nproc, args):
    with common.clean_exit(f"[rank {args.node_rank * nproc + local_rank}] "):
        train(local_rank, nproc, args)


def train(local_rank, nproc, args):
    # Who am I: the global rank counts processes over all nodes, local_rank within this one.
    rank = args.node_rank * nproc + local_rank
    world_size = args.nnodes * nproc

    # One GPU per process and NCCL between GPUs; without GPUs, gloo between CPU processes,
    # each with its share of the cores (otherwise every process uses them all and they thrash).
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(common.threads_per_process(nproc))

    # Meet the others at node 0's address. The timeout makes a missing or dead peer an error
    # within about a minute instead of a hang for the 30-minute default.
    dist.init_process_group(backend, init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL: this GPU
    report = common.Reporter(args, rank, world_size)
    report.log(f"{world_size} processes ({args.nnodes} node(s) x {nproc}), backend {backend}, "
               f"device {device.type}, {torch.get_num_threads()} thread(s) each")
    report.log(common.describe_lr(args))

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
    with common.clean_exit():
        main()
