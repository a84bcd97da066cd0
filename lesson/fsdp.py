"""The lesson's next chapter: ddp.py made FSDP2 (fully_shard), for a model that outgrows DDP:
each process keeps 1/N of the weights, gradients and optimizer state (docs/fsdp.md).
FSDP2 needs torch 2.7 or later (2.6 on CUDA); and torchvision: nothing else of this repository.

    torchrun --standalone --nproc-per-node 2 lesson/fsdp.py --epochs 2 --checkpoint lesson.pt
"""
import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
# Before init_process_group, on purpose: torchvision imports torch.distributed.nn, which, if
# imported later, pins the group: gloo's threads then outlive it and can abort the exit.
from torchvision.datasets import MNIST


class Net(nn.Module):
    """Two convolutions with BatchNorm, whose running statistics are buffers, and a small head.
    No bias in a convolution before BatchNorm: subtracting the batch mean cancels it."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


def mnist(data_dir, train):
    """MNIST's training or test set as two tensors in memory, normalised (downloaded if missing)."""
    data = MNIST(data_dir, train=train, download=True)
    return TensorDataset((data.data.float().unsqueeze(1) / 255 - 0.1307) / 0.3081, data.targets)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", default="./data", help="MNIST's folder (torchvision's layout)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256, help="the global batch")
    p.add_argument("--checkpoint", help="where to save the model after every epoch")
    args = p.parse_args()
    # torchrun tells each process who it is in its environment: LOCAL_RANK (0, 1, ... on this
    # machine), RANK and WORLD_SIZE (over all machines), and where to meet (MASTER_ADDR/PORT).
    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: start it with torchrun: torchrun --nproc-per-node 2 lesson/fsdp.py")
    local_rank, cuda = int(os.environ["LOCAL_RANK"]), torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")  # its own GPU
    if cuda:
        torch.cuda.set_device(device)
    # The process group, in which every collective (all-reduce, barrier) runs; it reads
    # torchrun's environment, which is all it needs.
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if local_rank == 0:
        MNIST(args.data_dir, download=True)  # once a machine (a disk machines share: beforehand)
    dist.barrier()  # the others wait until the first process of their machine has it

    train_set, test_set = mnist(args.data_dir, train=True), mnist(args.data_dir, train=False)
    batch_size = args.batch_size // world_size  # its part of the global batch: 256 at 3 is 85
    # A shard of its own, padded with repeats to equal length (7 processes train 60,004 of
    # 60,000); the test set's shards take every sample once, unpadded, so that none counts twice.
    sampler = DistributedSampler(train_set, world_size, rank, seed=0)
    loader = DataLoader(train_set, batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size, sampler=range(rank, len(test_set), world_size))

    torch.manual_seed(0)  # the initial weights, the same in every process: FSDP sends none
    model = Net()  # whole in host memory; sharding moves each process's shard to its device
    # Each unit's weights are split over the processes and gathered whole only for its forward
    # and backward; its gradients are reduce-scattered: each process keeps its shard's. The
    # units here are the two halves, then the model itself (whatever is left).
    for unit in (model.features, model.head):
        fully_shard(unit)
    fully_shard(model)  # the model is now FSDP's: train, evaluate and save it, no wrapper
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # after: over the shards

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same in every process
        model.train()
        totals = torch.zeros(2, device=device)  # the loss summed over the samples, the samples
        for inputs, target in loader:
            inputs, target = inputs.to(device), target.to(device)
            loss = F.cross_entropy(model(inputs), target)  # gathers each unit's weights
            optimizer.zero_grad()
            loss.backward()  # FSDP reduce-scatters the gradients here
            optimizer.step()
            totals[0] += loss.detach() * len(target)  # added up on the device: no wait per step
            totals[1] += len(target)
        dist.all_reduce(totals)  # SUMS each over the processes: all processes' loss and samples
        train_loss = (totals[0] / totals[1]).item()

        model.eval()
        for buffer in model.buffers():  # BatchNorm's statistics, which each process updated
            dist.broadcast(buffer, src=0)  # with its own batches: rank 0's (the saved ones)
        counts = torch.zeros(2, device=device)  # correct predictions, test samples
        # Each forward gathers weights, a collective: every process runs as many as rank 0,
        # whose shard of the test set is the longest: range(rank, N, world_size) gives rank 0
        # ceil(N / world_size) samples (101 at 2: 51 and 50), so at most one batch more.
        most = math.ceil(math.ceil(len(test_set) / world_size) / batch_size)
        batches = iter(test_loader)
        with torch.no_grad():
            for i in range(most):
                if i < len(test_loader):
                    inputs, target = next(batches)
                else:  # past its shard: its last batch again, counted as none
                    target = target[:0]
                output = model(inputs.to(device))[:len(target)]
                counts[0] += (output.argmax(1) == target.to(device)).sum()
                counts[1] += len(target)
        dist.all_reduce(counts)  # SUMS each over the processes: each test sample counted once
        correct, total = counts.tolist()
        report = (f"epoch {epoch + 1} train_loss {train_loss:.4f} test_acc "
                  f"{100 * correct / total:.4g} correct {correct:.0f} total {total:.0f}")
        # The whole model, gathered from every process's shards into rank 0's memory (a
        # collective: all take part). torchrun_fsdp.py instead writes each process's shards.
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=whole) if args.checkpoint else None
        if args.checkpoint and rank == 0:  # one writer: the plain model, no "module." prefix
            torch.save({"model": state, "epoch": epoch + 1}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # whole, or the last one
        dist.barrier()  # nobody runs ahead, or exits, before the checkpoint is complete
        if rank == 0:  # one line per epoch, not one per process
            print(report, flush=True)
    dist.destroy_process_group()  # leaves the group (its threads live on: see the end)


if __name__ == "__main__":
    main()
    # torch keeps FSDP's process group after destroy_process_group (in DTensor's caches), and a
    # thread of it can crash Python's shutdown: the process ends here instead, its output out.
    sys.stdout.flush()
    os._exit(0)
