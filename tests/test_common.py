"""The pieces of common.py that make the DataLoader path exact under DDP, each checked in this
process (no launch): the batched MNIST dataset and its collate, per-sample seeds for random
augmentation (also through persistent workers), a mid-epoch resume that skips in the sampler,
per-step seeds for dropout, one write per diagnostic line, the port check after a run that
just ended, the resume decision of a single process, SIGTERM without a checkpoint, and the LR
schedule after a skipped fp16 step. The multi-process behaviour is tested by launching the
scripts (test_data_loading.py and the per-script files)."""
import argparse
import os
import random
import re
import signal
import socket

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import common
from conftest import N_TEST, N_TRAIN, free_port


def args_for(data=None, **kw):
    """The scripts' defaults, as parsed, with some values replaced."""
    args = common.build_parser("").parse_args(["--data-dir", str(data)] if data else ["--dummy"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


# ---- the MNIST task ----------------------------------------------------------------------

def test_mnist_is_read_as_torchvision_reads_it(tiny_mnist):
    """common.read_idx (no torchvision import in every process) gives what torchvision's own
    MNIST reader gives, and the batched fetch equals the per-sample one."""
    from torchvision.datasets import MNIST
    train, test = common.make_datasets(args_for(tiny_mnist))
    assert (len(train), len(test)) == (N_TRAIN, N_TEST)
    ref = MNIST(str(tiny_mnist), train=True, download=False)
    expected = common.InMemoryMNIST(ref.data, ref.targets)
    assert torch.equal(train.images, expected.images) and torch.equal(train.labels, expected.labels)
    indices = [5, 3, 599, 0]
    x, y = train.__getitems__(indices)
    per_sample = default_collate([train[i] for i in indices])
    assert torch.equal(x, per_sample[0]) and torch.equal(y, per_sample[1])


def test_collate_passes_a_whole_batch_through_and_collates_samples():
    batch = (torch.zeros(4, 1, 28, 28), torch.arange(4))
    assert common.collate(batch) is batch
    x, y = common.collate([(torch.ones(3), 1), (torch.zeros(3), 2)])
    assert x.shape == (2, 3) and y.tolist() == [1, 2]


# ---- random augmentation: drawn per sample from (seed, epoch, index) -----------------------

class Draws(Dataset):
    """What a torchvision transform does: draw from torch's global RNG (and Python's)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor([index, torch.randint(0, 2 ** 30, ()).item(), random.random() * 2 ** 30])


def draws(loader):
    return {int(row[0]): tuple(row[1:].tolist()) for x in loader for row in x}


def test_per_sample_seeds_do_not_depend_on_order_workers_or_rank():
    data = common.PerSampleSeeds(Draws(), seed=7)
    data.set_epoch(3)
    single = draws(DataLoader(data, batch_size=5))
    shuffled = draws(DataLoader(data, batch_size=8, shuffle=True, num_workers=2,
                                worker_init_fn=common.worker_init))
    assert single == shuffled  # any order, any number of workers: sample i draws the same
    assert len({v for v in single.values()}) == len(single)  # and samples differ
    data.set_epoch(4)
    assert all(a != b for a, b in zip(single.values(), draws(DataLoader(data, batch_size=5)).values()))
    other_seed = common.PerSampleSeeds(Draws(), seed=8)
    other_seed.set_epoch(3)
    assert draws(DataLoader(other_seed, batch_size=5)) != single


def test_without_them_every_rank_draws_the_same():
    """The trap they avoid: each rank seeds its RNG alike, and DataLoader seeds its workers from
    it, so rank 0 and rank 1 (here: two loaders over disjoint halves, one seed) draw the same."""
    halves = []
    for rank in (0, 1):
        torch.manual_seed(0)
        loader = DataLoader(Draws(), batch_size=4, sampler=range(rank * 32, rank * 32 + 32),
                            num_workers=2)
        halves.append([d for _, d in sorted(draws(loader).items())])
    assert halves[0] == halves[1]


@pytest.mark.parametrize("persistent", [False, True])
def test_the_epoch_reaches_workers_persistent_ones_too(persistent):
    """set_epoch writes to shared memory: workers started in epoch 0 and kept alive
    (persistent_workers=True) still draw epoch 1's values in epoch 1."""
    data = common.PerSampleSeeds(Draws(), seed=0)
    loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=persistent,
                        worker_init_fn=common.worker_init,
                        multiprocessing_context=common.worker_start(2))  # as the scripts start them
    by_epoch = []
    for epoch in range(2):
        data.set_epoch(epoch)
        by_epoch.append(draws(loader))
    fresh = common.PerSampleSeeds(Draws(), seed=0)
    fresh.set_epoch(1)
    assert by_epoch[1] == draws(DataLoader(fresh, batch_size=8)) != by_epoch[0]


class Whereabouts(Dataset):
    """Each sample: the worker's pid, its parent's, and the pid it takes for its training process."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([os.getpid(), os.getppid(), torch.multiprocessing.parent_process().pid])


def test_workers_start_from_a_fork_server_with_one_thread():
    """common.worker_start: a training process has the process group's threads, and a worker
    forked from it can hang before its first line (python/cpython#112275). The scripts' workers
    are forked from a server with one thread instead, which the job's SIGTERM leaves alone
    (blocked), and each worker still takes this process for its training process (worker_init
    exits on a SIGTERM from it, the DataLoader shutting it down)."""
    assert common.worker_start(0) is None
    loader = DataLoader(Whereabouts(), batch_size=1, num_workers=2, worker_init_fn=common.worker_init,
                        multiprocessing_context=common.worker_start(2))
    rows = [batch[0].tolist() for batch in common.start_workers(loader)]
    assert len({pid for pid, _, _ in rows}) == 2
    servers = {parent for _, parent, _ in rows}
    assert len(servers) == 1 and os.getpid() not in servers
    status = open(f"/proc/{servers.pop()}/status").read()
    assert re.search(r"^Threads:\s+1$", status, re.M)
    blocked = int(re.search(r"^SigBlk:\s+(\w+)$", status, re.M).group(1), 16)
    assert blocked >> (signal.SIGTERM - 1) & 1
    assert {training for _, _, training in rows} == {os.getpid()}


def test_a_batched_dataset_is_passed_through_with_one_seed_per_batch():
    train, _ = common.make_datasets(args_for(None))
    data = common.PerSampleSeeds(train, seed=0)
    x, y = data.__getitems__([1, 2, 3])
    assert torch.equal(x, train.images[[1, 2, 3]])
    assert not hasattr(common.PerSampleSeeds(Draws(), 0), "__getitems__")


def test_dropout_draws_per_rank_and_again_after_a_resume():
    drop = torch.nn.Dropout(0.5)

    def mask(rank, epoch=0, step=1):
        common.seed_step(0, epoch, step, rank)
        return drop(torch.ones(1000)) > 0
    assert torch.equal(mask(0), mask(0))  # the same (epoch, step, rank): the same mask
    assert not torch.equal(mask(0), mask(1))  # another rank
    assert not torch.equal(mask(0, step=2), mask(0))  # another step


# ---- a mid-epoch resume skips in the sampler ----------------------------------------------

class Counted(Dataset):
    def __init__(self):
        self.fetched = []

    def __len__(self):
        return 100

    def __getitem__(self, index):
        self.fetched.append(index)
        return torch.tensor(index)


def test_resume_skips_in_the_sampler_without_loading_the_skipped_samples():
    from torch.utils.data.distributed import DistributedSampler
    data = Counted()
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    full = [int(i) for b in DataLoader(data, batch_size=8, sampler=sampler) for i in b]
    data.fetched.clear()
    resumable = common.ResumableSampler(sampler)
    resumable.skip = 3 * 8  # 3 steps done
    loader = DataLoader(data, batch_size=8, sampler=resumable)
    rest = [[int(i) for i in b] for b in loader]
    assert sum(rest, []) == full[24:]  # the same batches as the uninterrupted epoch's
    assert rest[0] == full[24:32]
    assert sorted(data.fetched) == sorted(full[24:])  # nothing loaded for the first 3 steps


# ---- diagnostics, ports, the resume decision, SIGTERM, the LR after a skipped step ----------

def test_an_error_line_is_one_write(monkeypatch):
    """Several ranks writing to one pipe: a line in two writes (print's text, then its newline)
    can be split by another rank's line (seen in CI). common.say writes it in one."""
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or real_write(fd, data))
    r, w = os.pipe()
    with os.fdopen(w, "w") as f:
        common.say("[rank 1] error: distributed: Unable to find address for: nosuchif0", f)
    with os.fdopen(r) as f:
        assert f.read() == "[rank 1] error: distributed: Unable to find address for: nosuchif0\n"
    assert [data for fd, data in writes if fd == w] == \
        [b"[rank 1] error: distributed: Unable to find address for: nosuchif0\n"]


def test_the_port_of_a_store_that_just_ended_is_free_but_a_listening_one_is_not():
    """The cause of a requeued SLURM job failing with "port ... already in use": the previous
    run's store closes its connections first, which leaves them in TIME_WAIT on its port for a
    minute. A new store binds that port all the same (its socket has SO_REUSEADDR, and so had
    the old one's); a check without the option refused it."""
    from datetime import timedelta
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"
    del store  # the server closes first: its side of the connection waits in TIME_WAIT
    del client
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # the old check: refused
    common.check_port_free(port)  # the check now: the store can take it...
    again = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10))  # ...it can
    with pytest.raises(common.Fatal, match=f"port {port} is already in use"):
        common.check_port_free(port)  # while a store listens there, the port is taken
    del again


def test_one_process_resumes_only_when_asked_and_found(tmp_path):
    path = str(tmp_path / "c.pt")
    cpu = torch.device("cpu")
    assert common.agreed_checkpoint(path, common.RESUME_IF_FOUND, cpu) is None
    with pytest.raises(common.Fatal, match="no checkpoint at"):
        common.agreed_checkpoint(path, common.RESUME, cpu)
    torch.save({"model": {}, "epoch": 2, "step": 5}, path)
    assert common.agreed_checkpoint(path, common.NO_RESUME, cpu) is None
    assert common.agreed_checkpoint(path, common.RESUME_IF_FOUND, cpu)["step"] == 5


def test_sigterm_without_a_checkpoint_stops_at_once():
    stop = common.StopSignal(snapshot=False)
    try:
        with pytest.raises(common.Preempted, match="nothing saved"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between two bytecodes
                pass
    finally:
        stop.close()
    stop = common.StopSignal(snapshot=True)
    try:
        assert not stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop() and stop()  # with one: a flag, read before every step
    finally:
        stop.close()


def test_the_schedule_waits_for_a_step_that_fp16_skipped(monkeypatch):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step + 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    calls = []
    real = scaler.get_scale
    monkeypatch.setattr(scaler, "get_scale", lambda: calls.append(1) or real())
    lr = common.SchedulerAfterScaler(scheduler, scaler)
    calls.clear()
    for grad in (1.0, float("inf"), 1.0):  # the second step overflows: skipped
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2)).sum() * grad).backward()
        scaler.step(optimizer)
        scaler.update()
        lr.step()
    assert scheduler.last_epoch == 2  # 2 real steps, not 3
    assert len(calls) == 3  # one get_scale per step
    off = common.SchedulerAfterScaler(scheduler, torch.amp.GradScaler("cpu", enabled=False))
    off.step()
    assert scheduler.last_epoch == 3


def test_the_task_is_looked_up_at_call_time(monkeypatch, tmp_path):
    """Redefining make_model (as docs/your-own-task.md does at the end of common.py) reaches the
    checkpoint check too: a checkpoint of the new model passes, one of Net does not."""
    monkeypatch.setattr(common, "make_model", lambda args: torch.nn.Linear(3, 2))
    torch.save({"model": torch.nn.Linear(3, 2).state_dict(), "epoch": 1}, tmp_path / "new.pt")
    torch.save({"model": common.Net().state_dict(), "epoch": 1}, tmp_path / "old.pt")
    ok = args_for(None, checkpoint=str(tmp_path / "new.pt"), resume=True)
    common.check_args(ok, world_size=1, local_processes=1)
    bad = args_for(None, checkpoint=str(tmp_path / "old.pt"), resume=True)
    with pytest.raises(common.Fatal, match="does not fit this model"):
        common.check_args(bad, world_size=1, local_processes=1)


def test_micro_batches_deal_samples_as_more_ranks_would():
    x, y = torch.arange(8).float(), torch.arange(8)
    parts = list(common.micro_batches(x, y, 2))
    assert [(k, yk.tolist(), share, last) for k, _, yk, share, last in parts] == \
        [(0, [0, 2, 4, 6], 0.5, False), (1, [1, 3, 5, 7], 0.5, True)]


def test_an_argparse_namespace_is_all_a_task_needs():
    """The recipe functions take the parsed flags only (what a replaced task receives)."""
    args = argparse.Namespace(lr=0.01, batch_size=1024, lr_scaling="sqrt", epochs=2,
                              warmup_epochs=0.2)
    assert common.peak_lr(args) == pytest.approx(0.02)
    model = common.make_model(args)
    scheduler = common.make_scheduler(common.make_optimizer(model, args), args, 10)
    assert scheduler.get_last_lr()[0] < common.peak_lr(args)  # warming up
