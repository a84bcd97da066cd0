"""The data path: each process's shard skipped to where a resume continues, random numbers
drawn per sample and per step (the same at any world size, with any workers, after a resume),
--accumulate's micro-batches, and data workers that share the training process's memory and
outlive a SIGTERM not meant for them (sigterm.py). docs/training.md says why each is so."""
import hashlib
import itertools
import random
import sys

import numpy
import torch
from torch.utils.data import Dataset, Sampler

import common

from . import sigterm


class Skippable(Sampler):
    """A sampler whose next pass leaves out its first `skip` indices: a resume in the middle of
    an epoch skips what was trained, and nothing is loaded for it."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


def drop_last(shard, batch, accumulate):
    """Whether each process leaves out the last batch of its shard: where it would hold a
    micro-batch of one sample (fewer than 2 x --accumulate samples), which BatchNorm cannot
    normalise in training ("Expected more than 1 value per channel"), after a whole epoch. The
    shards are equally long: every process leaves it, and all take the same number of steps."""
    return 0 < shard % batch < 2 * accumulate


# ---- Random numbers that depend on (seed, epoch, sample or step, rank) only ----------------

def mix(*values):
    """A 63-bit seed from a tuple of integers, well spread (blake2b)."""
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(),
                          "little") >> 1


class PerSampleSeeds(Dataset):
    """A training set whose draws from torch's, Python's and NumPy's global RNG (random
    augmentation: torchvision, albumentations, imgaug) are seeded per sample from (seed, epoch,
    index): different on every rank and in every epoch,
    the same at any world size, with any workers, after a resume. (DataLoader would seed its
    workers from each process's RNG, the same on every rank.) The epoch is in shared memory, so
    that the workers see set_epoch too. A dataset that returns whole batches (__getitems__) is
    seeded once per batch, from its first index."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()
        if callable(getattr(dataset, "__getitems__", None)):
            self.__getitems__ = self._getitems

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def _seed(self, index):
        seed = mix(self.seed, int(self.epoch), int(index))
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed & 0xFFFFFFFF)  # NumPy's takes 32 bits (2.5 us; 64: 10 us)

    def __getitem__(self, index):
        self._seed(index)
        return self.dataset[index]

    def _getitems(self, indices):
        self._seed(indices[0])
        return self.dataset.__getitems__(indices)


def seed_step(seed, epoch, step, rank, gpus=None):
    """Seeds this process's RNG before a forward pass: dropout draws differently on every rank,
    and again the same after a resume. Micro-batch k of --accumulate passes the rank that would
    compute it with N times the processes. Dropout on a GPU draws from that GPU's generator:
    this process's GPU, or each of `gpus` (DataParallel's replicas), each seeded on its own."""
    torch.default_generator.manual_seed(mix(seed, epoch, step, rank))  # (torch.manual_seed:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # 0.1 ms a call on a CPU)
        for i, gpu in enumerate([torch.cuda.current_device()] if gpus is None else gpus):
            torch.cuda.default_generators[gpu].manual_seed(mix(seed, epoch, step, rank, i))


def micro_batches(inputs, target, n):
    """--accumulate n: (inputs, target, share, last) for each micro-batch k, which takes every
    n-th sample from the k-th, of every tensor of the batch: what rank r + W*k of W*n processes
    would get. Each loss is weighted by its share, so that the gradients add up to the batch's."""
    n = min(n, len(target))  # a last batch shorter than n gives no empty micro-batch
    for k in range(n):
        x = common.map_tensors(lambda t: t[k::n], inputs)  # every tensor of the inputs
        yield x, target[k::n], len(target[k::n]) / len(target), k == n - 1


# ---- Data workers ---------------------------------------------------------------------------

def worker_options(workers):
    """The DataLoader's worker options. Forked from the training process, the workers share its
    memory: the dataset is neither copied into /dev/shm nor sent over one descriptor per tensor
    ("too many fds"), as with a fork server or spawn. They start once (start_workers), before
    the process group: a fork while its threads run can hang the child on CPython before 3.11.10
    (python/cpython#112275). Elsewhere than Linux: the platform's way."""
    if not workers:
        return {}
    return {"persistent_workers": True, "worker_init_fn": sigterm.worker_init,
            "multiprocessing_context": "fork" if sys.platform == "linux" else None}


def start_workers(*loaders):
    """The loaders' workers, started now, with an empty sampler (nothing is loaded until the
    first epoch asks), SIGTERM blocked in them until sigterm.worker_init takes it over."""
    with sigterm.blocked():
        for loader in loaders:
            if loader.num_workers:
                sampler, loader.batch_sampler.sampler = loader.batch_sampler.sampler, []
                iter(loader)
                loader.batch_sampler.sampler = sampler
