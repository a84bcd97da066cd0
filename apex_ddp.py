"""NVIDIA apex: apex.amp mixed precision, apex's DistributedDataParallel and SyncBN,
with the native PyTorch equivalent beside every apex line. Launched like torchrun_ddp.py:

    torchrun --standalone --nproc-per-node=2 apex_ddp.py --opt-level O1
    python -m torch.distributed.launch --nproc-per-node=2 apex_ddp.py

Where apex imports (a source build of release 25.05 or older: later releases removed apex.amp
and apex.parallel) and CUDA is present, it runs the apex way. Otherwise, or with --native, it
runs the same steps with torch.autocast, torch.amp.GradScaler, nn.SyncBatchNorm and
torch.nn.parallel.DistributedDataParallel. It says at start which one it took, and why.
"""
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common

try:  # NOT `pip install apex`: that is an unrelated web package (docs/apex.md)
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
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))  # the old launcher: flag
    common.check_args(args, world_size=world_size, local_processes=nproc,
                      one_node=nproc == world_size, elastic=True, notes=local_rank == 0,
                      cuda=gpus > 0 or (use_apex and standin))
    # GROUP_RANK: torchrun's index of this machine; its node 0 holds global rank 0.
    common.check_outputs(args, int(os.environ.get("GROUP_RANK", 0)), notes=local_rank == 0)
    train(local_rank, nproc, args, use_apex, why)


def train(local_rank, nproc, args, use_apex, why):
    rank = int(os.environ.get("RANK", 0))  # over all nodes; local_rank: on this one
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # 0, then 1 after a restart
    device = common.process_device(local_rank, nproc)  # one GPU each, or a share of the cores

    # Meet the others through a store, or give up after --join-timeout.
    if nproc == world_size:  # one machine
        common.on_loopback()  # gloo's and NCCL's own sockets (torchrun's: docs/security.md)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" and nproc == world_size:
        # the agent shares no store (docs/security.md): rank 0 hosts one on loopback
        store = common.loopback_store(int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                                      timeout=timedelta(seconds=args.join_timeout))
    elif "RANK" in os.environ:  # torchrun's agent hosts it at MASTER_ADDR:MASTER_PORT. Keys are
        # prefixed with the restart count: after a restart the store still holds the dead
        # round's addresses, and gloo may try to connect to them (pytorch/pytorch#167288).
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=args.join_timeout)))
        store = dist.PrefixStore(f"restart{restart}/", store)
    else:  # plain `python torchrun_ddp.py`: a group of one, in memory, no port needed
        store = dist.HashStore()
    # NCCL between GPUs, gloo between CPUs; --timeout: how long a collective waits for the rest.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.timeout))
    common.say_once(f"{world_size} processes ({world_size // nproc} node(s) x {nproc}), restart "
                    f"{restart} (TORCHELASTIC_RESTART_COUNT)", device)
    if rank == 0:
        print(f"path: {why}", flush=True)
    if local_rank == 0:  # download once per machine, before anyone reads the files
        common.prepare_data(args)
    dist.barrier()
    # Elastic: a group that torchrun (re)starts continues from the snapshot, if any has one.
    wish = common.RESUME if args.resume or args.evaluate else common.RESUME_IF_FOUND
    trainer = Trainer(args, device, rank, world_size, local_rank, wish, use_apex)
    trainer.evaluate() if args.evaluate else trainer.train()
    dist.destroy_process_group()


class Trainer:
    """One process's share of the training: set-up, one step, one epoch, a snapshot."""

    def __init__(self, args, device, rank, world_size, local_rank, wish, use_apex):
        self.args, self.device, self.rank, self.world_size = args, device, rank, world_size
        self.use_apex = use_apex
        self.report = common.Reporter(args, self.rank, self.world_size)
        self.report.log(common.describe_lr(args))

        # Data: the sampler deals each process its own shard (the same seed everywhere, or the
        # shards overlap), and each process loads its part of the global batch. Augmentation
        # is drawn per sample from (seed, epoch, index): different on every rank.
        train_set, self.test_set = common.make_datasets(args)
        self.train_set = common.PerSampleSeeds(train_set, args.seed)
        self.sampler = DistributedSampler(self.train_set, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=args.seed)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size // world_size,
                                 sampler=common.ResumableSampler(self.sampler),
                                 num_workers=args.workers, worker_init_fn=common.worker_init,
                                 multiprocessing_context=common.worker_start(args.workers),
                                 pin_memory=device.type == "cuda", collate_fn=common.collate)
        self.steps = len(self.loader)

        # Model: the same seed, so the same initial weights in every process. apex's order:
        # model on the GPU, convert_syncbn_model, the optimizer, amp.initialize, then (after
        # any checkpoint is loaded) the DDP wrap.
        torch.manual_seed(args.seed)
        self.layout = torch.channels_last if args.channels_last else torch.preserve_format
        model = common.make_model(args).to(device, memory_format=self.layout)
        if args.sync_bn and use_apex:
            model = convert_syncbn_model(model)
        elif args.sync_bn:  # before the DDP wrap
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.optimizer = common.make_optimizer(model, args)
        if use_apex:  # O1 patches torch functions to cast per op; O2 keeps fp32 master weights
            model, self.optimizer = amp.initialize(model, self.optimizer, opt_level=args.opt_level)
        self.scheduler = common.make_scheduler(self.optimizer, args, self.steps)
        self.amp = common.AMP_DTYPES[args.amp]  # natively: torch.autocast replaces the patching
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16: none

        # Resume from --checkpoint: all processes decide together (common.agreed_checkpoint).
        self.epoch, self.step = 0, 0
        ckpt = common.agreed_checkpoint(args.checkpoint, wish, device, self.report.log)
        if ckpt:
            self.epoch, self.step = common.restore(ckpt, model, self.optimizer, self.scheduler,
                                                   self.scaler, args.checkpoint)
            if use_apex and "amp" in ckpt:  # after amp.initialize, as apex documents
                amp.load_state_dict(ckpt["amp"])
            self.report.log(f"loaded {args.checkpoint}: {self.epoch} epoch(s) + {self.step} "
                            "step(s) trained")
        self.lr = common.SchedulerAfterScaler(self.scheduler, self.scaler)
        self.loss_scale = self._loss_scale()

        # DDP all-reduces the gradients during backward: every replica takes the same step.
        # apex's DDP with delay_allreduce=True all-reduces once, after the whole backward pass.
        if use_apex:
            self.model = ApexDDP(model, delay_allreduce=True)
        else:
            self.model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
        self.model = torch.compile(self.model) if args.compile else self.model  # after the wrap
        # One writer (several writing a shared disk corrupt the file), or one per node.
        self.writer = (local_rank if args.save_on_each_node else rank) == 0
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
                loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen  # all processes
                lr = self.scheduler.get_last_lr()[0]
                self.report.progress(epoch, step, self.steps, loss, lr, stats)
            if self.args.save_every and step % self.args.save_every == 0 and step < self.steps:
                self._save_snapshot(epoch, step)
        train_loss = common.reduce_tensor(stats.loss_sum).item() / stats.seen  # over all processes
        speed = stats.speed(self.world_size)  # the epoch's, before the evaluation
        accuracy = common.accuracy_fields(*self._evaluate())
        self._save_snapshot(epoch + 1, 0)
        self.report.record(epoch=epoch + 1, train_loss=train_loss, **accuracy, **speed)

    def _run_batch(self, epoch, step, x, y, stats):
        x = x.to(self.device, non_blocking=True, memory_format=self.layout)
        y = y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad()  # no set_to_none=: apex O2 patches it without arguments
        # --accumulate N: N micro-batches add their gradients, then one optimizer step.
        for k, xk, yk, share, last in common.micro_batches(x, y, self.args.accumulate):
            # Dropout: a different draw on every rank (the one that would take micro-batch k
            # with N times the processes), and the same again after a resume.
            common.seed_step(self.args.seed, epoch, step, self.rank + self.world_size * k)
            with (apex_sync_on if self.use_apex else common.sync_on)(last, self.model):
                with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                    loss = common.loss_fn(self.model(xk), yk)
                if self.use_apex:  # averaged over processes in here, on the last micro-batch.
                    # delay_unscale: leave the earlier micro-batches' gradients in .grad for
                    # that all-reduce; otherwise amp moves them aside before each backward
                    # and adds them back after it, never all-reduced.
                    with amp.scale_loss(loss * share, self.optimizer,
                                        delay_unscale=not last) as scaled_loss:
                        scaled_loss.backward()
                else:
                    self.scaler.scale(loss * share).backward()  # DDP averages the gradients here
            stats.add(loss, len(yk))
        if self.use_apex:
            self.optimizer.step()  # amp makes this a no-op after an overflow
            scale, self.loss_scale = self.loss_scale, self._loss_scale()
            if self.loss_scale >= scale:  # apex lowers the scale when it skipped the step
                self.scheduler.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.lr.step()  # not after a step that fp16's scaler skipped

    def _loss_scale(self):
        return amp.state_dict()["loss_scaler0"]["loss_scale"] if self.use_apex else None

    def _evaluate(self):  # exact: every test sample counted once
        return common.evaluate(self.model.module, self.test_set, self.device, self.loader.batch_size,
                               self.args.workers, self.rank, self.world_size)

    def _save_snapshot(self, epoch, step):
        if self.writer and self.args.checkpoint:  # the unwrapped model: no "module." prefix
            state = common.checkpoint_state(self.model.module, self.optimizer, self.scheduler,
                                            self.scaler, epoch, step, self.args)
            if self.use_apex:
                state["amp"] = amp.state_dict()  # the loss scale, like the scaler's
            common.save_checkpoint(state, self.args.checkpoint)
        dist.barrier()  # nobody runs ahead, or exits, before the snapshot is complete


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
