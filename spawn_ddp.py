"""DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python spawn_ddp.py --nproc-per-node 2     # one machine; several: docs/clusters.md
"""
import signal
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import common


def main():
    parser = common.build_parser(__doc__)
    g = parser.add_argument_group("launch (spawn)")
    g.add_argument("--nproc-per-node", type=common.positive_int, help="processes on this "
                   "machine (default: one per GPU, or 2 without a GPU)")
    g.add_argument("--nnodes", type=common.positive_int, default=1, help="machines (default: 1)")
    g.add_argument("--node-rank", type=common.natural_int, default=0, help="this machine's index")
    g.add_argument("--master-addr", help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=common.port_number, help="a free port on node 0 (one "
                   "machine without it: a private file, no port)")
    args = parser.parse_args()

    nproc = args.nproc_per_node or torch.cuda.device_count() or 2
    if args.nnodes > 1 and not (args.master_addr and args.master_port):
        raise common.Fatal("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if args.node_rank >= args.nnodes:
        raise common.Fatal(f"--node-rank must be in 0..{args.nnodes - 1}")
    common.check_args(args, world_size=args.nnodes * nproc, local_processes=nproc,
                      one_node=args.nnodes == 1)
    common.check_outputs(args, node_rank=args.node_rank)  # before any work that could be lost
    if args.node_rank == 0 and args.master_port:  # node 0 hosts the store on this port
        common.check_port_free(args.master_port)
    common.prepare_data(args)  # download once per machine, before training
    # Start nproc copies of worker(local_rank, ...), each in a fresh interpreter (CUDA needs it).
    with tempfile.TemporaryDirectory() as private:  # one machine: the store's file, ours alone
        workers = mp.spawn(worker, args=(nproc, f"{private}/store", args), nprocs=nproc, join=False)
        # A SIGTERM to this launcher alone (`kill PID`) goes on to the workers.
        signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in workers.processes])
        try:
            while not workers.join():
                pass
        except mp.ProcessExitedException as e:  # the worker has already said why
            raise common.ended(f"worker {e.error_index}", e.exit_code) from None
        finally:  # Ctrl-C, or a failure: no worker outlives the launcher
            [p.terminate() for p in workers.processes if p.is_alive()]


def worker(local_rank, nproc, store_file, args):
    with common.clean_exit(f"[rank {args.node_rank * nproc + local_rank}] "):
        train(local_rank, nproc, store_file, args)


def train(local_rank, nproc, store_file, args):
    rank = args.node_rank * nproc + local_rank  # over all nodes; local_rank: on this one
    world_size = args.nnodes * nproc
    device = common.process_device(local_rank, nproc)  # one GPU each, or a share of the cores
    # Meet the others through a store, or give up after --join-timeout.
    if args.master_port is None:  # one machine: a file in a private folder, no network port
        common.on_loopback()  # gloo's and NCCL's own sockets too
        store = dist.FileStore(store_file, world_size)
        store.set_timeout(timedelta(seconds=args.join_timeout))
    else:  # a TCP store that rank 0 hosts on node 0 (on every interface: docs/security.md)
        store = dist.TCPStore(args.master_addr or "127.0.0.1", args.master_port,
                              is_master=rank == 0, timeout=timedelta(seconds=args.join_timeout))
        common.same_nproc_on_every_node(store, nproc, args.node_rank, args.nnodes, rank)
    # NCCL between GPUs, gloo between CPUs; --timeout: how long a collective waits for the rest.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.timeout))
    common.say_once(f"{world_size} processes ({args.nnodes} node(s) x {nproc})", device)
    wish = common.RESUME if args.resume or args.evaluate else common.NO_RESUME
    trainer = Trainer(args, device, rank, world_size, local_rank, wish)
    trainer.evaluate() if args.evaluate else trainer.train()
    dist.destroy_process_group()


class Trainer:
    """One process's share of the training: set-up, one step, one epoch, a snapshot."""

    def __init__(self, args, device, rank, world_size, local_rank, wish):
        self.args, self.device, self.rank, self.world_size = args, device, rank, world_size
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

        # Model: the same seed, so the same initial weights in every process.
        torch.manual_seed(args.seed)
        self.layout = torch.channels_last if args.channels_last else torch.preserve_format
        model = common.make_model(args).to(device, memory_format=self.layout)
        if args.sync_bn:  # before the DDP wrap
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.optimizer = common.make_optimizer(model, args)
        self.scheduler = common.make_scheduler(self.optimizer, args, self.steps)
        self.amp = common.AMP_DTYPES[args.amp]
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16: none

        # Resume from --checkpoint: all processes decide together (common.agreed_checkpoint).
        self.epoch, self.step = 0, 0
        ckpt = common.agreed_checkpoint(args.checkpoint, wish, device, self.report.log)
        if ckpt:
            self.epoch, self.step = common.restore(ckpt, model, self.optimizer, self.scheduler,
                                                   self.scaler, args.checkpoint)
            self.report.log(f"loaded {args.checkpoint}: {self.epoch} epoch(s) + {self.step} "
                            "step(s) trained")
        self.lr = common.SchedulerAfterScaler(self.scheduler, self.scaler)

        # DDP all-reduces the gradients during backward: every replica takes the same step.
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
        self.optimizer.zero_grad(set_to_none=True)
        # --accumulate N: N micro-batches add their gradients, then one optimizer step.
        for k, xk, yk, share, last in common.micro_batches(x, y, self.args.accumulate):
            # Dropout: a different draw on every rank (the one that would take micro-batch k
            # with N times the processes), and the same again after a resume.
            common.seed_step(self.args.seed, epoch, step, self.rank + self.world_size * k)
            with common.sync_on(last, self.model):  # no all-reduce before the last micro-batch
                with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                    loss = common.loss_fn(self.model(xk), yk)
                self.scaler.scale(loss * share).backward()  # DDP averages the gradients here
            stats.add(loss, len(yk))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr.step()  # not after a step that fp16's scaler skipped

    def _evaluate(self):  # exact: every test sample counted once
        return common.evaluate(self.model.module, self.test_set, self.device, self.loader.batch_size,
                               self.args.workers, self.rank, self.world_size)

    def _save_snapshot(self, epoch, step):
        if self.writer and self.args.checkpoint:  # the unwrapped model: no "module." prefix
            state = common.checkpoint_state(self.model.module, self.optimizer, self.scheduler,
                                            self.scaler, epoch, step, self.args)
            common.save_checkpoint(state, self.args.checkpoint)
        dist.barrier()  # nobody runs ahead, or exits, before the snapshot is complete


if __name__ == "__main__":
    with common.clean_exit():
        main()
