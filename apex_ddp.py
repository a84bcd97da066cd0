"""NVIDIA apex on MNIST: apex.amp mixed precision, apex's DistributedDataParallel and SyncBN,
with the native PyTorch equivalent beside every apex line. Launched like torchrun_ddp.py:

    torchrun --standalone --nproc-per-node=2 apex_ddp.py --opt-level O1
    python -m torch.distributed.launch --nproc-per-node=2 apex_ddp.py

Where apex imports (a source build of release 25.05 or older: later releases removed apex.amp
and apex.parallel) and CUDA is present, it runs the apex way. Otherwise, or with --native, it
runs the same steps with torch.autocast, torch.amp.GradScaler, nn.SyncBatchNorm and
torch.nn.parallel.DistributedDataParallel. It says at start which one it took, and why.
"""
import contextlib
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

try:  # NOT `pip install apex`: that is an unrelated web package (see README)
    import apex
    from apex import amp
    from apex.parallel import DistributedDataParallel as ApexDDP, convert_syncbn_model
    apex_problem = None
except Exception as e:  # missing, the wrong package, or a release without amp/parallel
    apex, apex_problem = None, f"{type(e).__name__}: {e}"


def main():
    parser = common.build_parser(__doc__)
    g = parser.add_argument_group("launch (torchrun) and apex")
    g.add_argument("--local-rank", "--local_rank", type=common.natural_int, default=0,
                   help="passed by python -m torch.distributed.launch; LOCAL_RANK from the "
                   "environment takes precedence")
    g.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"], default="O1",
                   help="apex amp opt level (default: O1). Natively O0 is fp32 and the others "
                   "autocast: float16 + GradScaler on GPUs, bfloat16 on a CPU with bfloat16 "
                   "instructions, fp32 on other CPUs")
    g.add_argument("--native", action="store_true", help="the native path even if apex works")
    args = parser.parse_args()
    if args.amp != "none":
        raise common.Fatal("apex_ddp.py sets the precision with --opt-level, not --amp")

    # torchrun tells each process who it is through the environment (LOCAL_RANK, RANK,
    # WORLD_SIZE, ...). Without those variables this is a single process.
    gpus = torch.cuda.device_count()
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if gpus and nproc > gpus:  # two processes on one GPU: NCCL refuses, or they fight over it
        raise common.Fatal(f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s)")
    # The stand-in package in tests/ runs apex's calls on CPU; real apex needs CUDA.
    standin = getattr(apex, "STAND_IN", False)
    if args.native:
        use_apex, why = False, "native PyTorch (--native)"
    elif apex is None:
        use_apex, why = False, f"native PyTorch: apex does not import ({apex_problem})"
    elif not (gpus or standin):
        use_apex, why = False, "native PyTorch: apex needs CUDA and there is no GPU"
    else:
        use_apex, why = True, f"apex ({apex.__file__}), amp opt level {args.opt_level}"
    if use_apex and args.compile:  # amp patches torch functions at run time: never tried here
        raise common.Fatal("--compile is untested with apex's amp and DDP; add --native")
    # Natively, O1-O3 become autocast: float16 + GradScaler on GPUs, and bfloat16 on a CPU
    # with bfloat16 instructions. On other CPUs both are slower than fp32, so: fp32.
    if not use_apex and args.opt_level != "O0":
        args.amp = "fp16" if gpus else "bf16" if common.fast_bf16_cpu() else "none"
    if not use_apex:
        why += f"; opt level {args.opt_level} -> " + {"none": "fp32", "bf16": "autocast bfloat16",
                                                     "fp16": "autocast float16 + GradScaler"}[args.amp]
        if args.opt_level != "O0" and args.amp == "none":
            why += f" (bfloat16 would be slower on this CPU: {common.amp_on_cpu_reason('bf16')})"
    if args.checkpoint and os.path.exists(args.checkpoint):
        args.resume = True  # elastic: a restarted group continues from the last snapshot
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))  # the old launcher: flag
    common.check_args(args, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                      cuda=gpus > 0 or (use_apex and standin), say=local_rank == 0)
    # GROUP_RANK: torchrun's index of this machine; its node 0 holds global rank 0.
    common.check_outputs(args, int(os.environ.get("GROUP_RANK", 0)), say=local_rank == 0)
    train(local_rank, nproc, args, use_apex, why)


def train(local_rank, nproc, args, use_apex, why):
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
    else:  # plain `python apex_ddp.py`: a group of one, in memory, no port needed
        store = dist.HashStore()
        common.gloo_on_loopback()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout,
                            device_id=device if device.type == "cuda" else None)  # NCCL: this GPU
    report = common.Reporter(args, rank, world_size)
    report.log(f"{world_size} processes ({world_size // nproc} node(s) x {nproc}), backend "
               f"{backend}, device {device.type}, {torch.get_num_threads()} thread(s) each, "
               f"restart {restart} (TORCHELASTIC_RESTART_COUNT)")
    report.log(f"path: {why}")
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
    # rank 0's at construction). apex's order: model on the GPU, convert_syncbn_model, the
    # optimizer, amp.initialize, then (after any checkpoint is loaded) the DDP wrap.
    common.seed_everything(args.seed)
    model = common.Net().to(device)
    if args.channels_last:  # NHWC weights: faster convolutions (README, Speed). MNIST's
        model = model.to(memory_format=torch.channels_last)  # one channel is NHWC already
    if args.sync_bn and use_apex:
        model = convert_syncbn_model(model)
    elif args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = common.make_optimizer(model, args)
    if use_apex:  # O1 patches torch functions to cast per op; O2 keeps fp32 master weights
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    scheduler = common.make_scheduler(optimizer, args, len(loader))
    amp_dtype = common.AMP_DTYPES[args.amp]  # natively: torch.autocast replaces the patching
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 needs none

    def loss_scale():  # both shrink the scale when they skip a step after an overflow
        return amp.state_dict()["loss_scaler0"]["loss_scale"] if use_apex else scaler.get_scale()

    start_epoch, start_step = 0, 0
    if args.resume or args.evaluate:  # every process loads, onto its own device
        ckpt = common.load_checkpoint(args.checkpoint, map_location=device)
        start_epoch, start_step = common.restore(ckpt, model, optimizer, scheduler, scaler,
                                                 args.checkpoint)
        if use_apex and "amp" in ckpt:  # after amp.initialize, as apex documents
            amp.load_state_dict(ckpt["amp"])
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
    # apex's DDP with delay_allreduce=True all-reduces once, after the whole backward pass.
    if use_apex:
        model = ApexDDP(model, delay_allreduce=True)
    else:  # device_ids only for CUDA: a CPU module takes None
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
                    if use_apex:
                        state["amp"] = amp.state_dict()
                    common.save_checkpoint(state, args.checkpoint)
                dist.barrier()  # nobody exits before the snapshot is complete
                raise common.Preempted(args, epoch, step - 1, say=rank == 0)
            optimizer.zero_grad()  # no set_to_none=: apex O2 patches it without arguments
            scale = loss_scale()
            # --accumulate N: N micro-batches add their gradients, then one optimizer step.
            for xk, yk, share, last in common.micro_batches(x, y, args.accumulate):
                with (apex_sync_on if use_apex else common.sync_on)(last, model):
                    with torch.autocast(device.type, dtype=amp_dtype,
                                        enabled=amp_dtype is not None):
                        loss = F.cross_entropy(model(xk), yk, label_smoothing=0.1)
                    if use_apex:  # averaged over processes in here, on the last micro-batch.
                        # delay_unscale: leave the earlier micro-batches' gradients in .grad
                        # for that all-reduce; otherwise amp moves them aside before each
                        # backward and adds them back after it, never all-reduced.
                        with amp.scale_loss(loss * share, optimizer,
                                            delay_unscale=not last) as scaled_loss:
                            scaled_loss.backward()
                    else:
                        scaler.scale(loss * share).backward()  # averaged over processes here
                loss_sum += loss.detach() * len(yk)
            if use_apex:
                optimizer.step()  # amp makes this a no-op after an overflow
            else:
                scaler.step(optimizer)
                scaler.update()
            if loss_scale() >= scale:  # fp16 skips a step with inf/NaN gradients and
                scheduler.step()       # lowers the scale: then keep the LR where it is
            seen += len(y)
            if step % args.log_interval == 0:  # a collective: every process reaches it together
                mean_loss = common.reduce_tensor(loss_sum).item() / seen
                report.progress(epoch, step, len(loader), mean_loss,
                                scheduler.get_last_lr()[0], timer.elapsed(), seen * world_size)
            if writer and args.save_every and step % args.save_every == 0 and step < len(loader):
                state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                                epoch, step, args)  # mid-epoch: no barrier
                if use_apex:
                    state["amp"] = amp.state_dict()  # the loss scale, like the scaler's
                common.save_checkpoint(state, args.checkpoint)
        train_loss = common.reduce_tensor(loss_sum).item() / seen  # the mean over all processes
        seconds = timer.elapsed()

        correct, total = common.evaluate(model.module, test_x, test_y, rank, world_size)
        if writer and args.checkpoint:
            state = common.checkpoint_state(model.module, optimizer, scheduler, scaler,
                                            epoch + 1, 0, args)
            if use_apex:
                state["amp"] = amp.state_dict()
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


@contextlib.contextmanager
def apex_sync_on(last, model):
    """common.sync_on for apex's DDP, which has no no_sync(): its all-reduce stays off, forward
    and backward, for every micro-batch but the last."""
    if not last:
        model.disable_allreduce()
    try:
        yield
    finally:
        model.enable_allreduce()


if __name__ == "__main__":
    with common.clean_exit(f"[rank {os.environ.get('RANK', 0)}] "):
        main()
