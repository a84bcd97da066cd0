"""The pieces of common.py and the modules of the machinery, each checked in this process (no
launch): the batched MNIST dataset and its collate, batches of any structure on the device,
per-sample seeds for random augmentation (also through persistent workers), data workers
forked before any thread of a process group, a mid-epoch resume that skips in the sampler,
per-step seeds for dropout, one write per diagnostic line, the port check after a run that
just ended, the resume decision of a single process, and SIGTERM without a checkpoint. The
multi-process behaviour is tested by launching the scripts (test_data_loading.py and the
per-script files)."""
import argparse
import collections
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import common
from ddpkit import checkpoint, data, flags, reporting, sigterm
from ddpkit.launch import Place
from ddpkit.task import SEAM, load_task
from conftest import N_TEST, N_TRAIN, free_port, read_metrics, read_tensorboard


def args_for(data=None, launcher="dp", **kw):
    """The scripts' defaults, as parsed, with some values replaced."""
    args = flags.parse_args("", launcher, ["--data-dir", str(data)] if data else ["--dummy"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


# ---- the MNIST task ----------------------------------------------------------------------

def test_mnist_is_read_as_torchvision_reads_it(tiny_mnist):
    """common.make_datasets gives torchvision's MNIST (its .data and .targets), normalised, and
    the batched fetch equals the per-sample one."""
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


Pair = collections.namedtuple("Pair", "images mask")


def test_inputs_of_any_structure_reach_the_device_and_the_model():
    """A tensor, a (named) tuple or a dict of tensors: moved whole, passed as model(x),
    model(*x) and model(**x); channels_last converts 4-D tensors (images) and nothing else."""
    images, mask = torch.zeros(2, 3, 4, 4), torch.ones(2, 5, dtype=torch.bool)
    moved = common.to_device({"images": images, "mask": mask}, torch.device("cpu"), True)
    assert moved["images"].is_contiguous(memory_format=torch.channels_last)
    assert moved["mask"].is_contiguous() and moved["mask"].dtype == torch.bool
    pair = common.to_device((images, mask), torch.device("cpu"))
    assert isinstance(pair, tuple) and pair[0].is_contiguous()
    named = common.to_device(Pair(images, mask), torch.device("cpu"), True)  # default_collate's
    assert isinstance(named, Pair) and named.images.is_contiguous(memory_format=torch.channels_last)
    seen = []
    model = lambda *a, **k: seen.append((len(a), sorted(k)))  # noqa: E731
    common.forward(model, images), common.forward(model, (images, mask))
    common.forward(model, {"images": images, "mask": mask})
    assert seen == [(1, []), (2, []), (0, ["images", "mask"])]


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
    dataset = data.PerSampleSeeds(Draws(), seed=7)
    dataset.set_epoch(3)
    single = draws(DataLoader(dataset, batch_size=5))
    shuffled = draws(DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
                                worker_init_fn=sigterm.worker_init))
    assert single == shuffled  # any order, any number of workers: sample i draws the same
    assert len({v for v in single.values()}) == len(single)  # and samples differ
    dataset.set_epoch(4)
    assert all(a != b for a, b in zip(single.values(), draws(DataLoader(dataset, batch_size=5)).values()))
    other_seed = data.PerSampleSeeds(Draws(), seed=8)
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
    dataset = data.PerSampleSeeds(Draws(), seed=0)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=persistent,
                        worker_init_fn=sigterm.worker_init, multiprocessing_context="fork")
    if persistent:
        data.start_workers(loader)  # as the scripts start them
    by_epoch = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        by_epoch.append(draws(loader))
    fresh = data.PerSampleSeeds(Draws(), seed=0)
    fresh.set_epoch(1)
    assert by_epoch[1] == draws(DataLoader(fresh, batch_size=8)) != by_epoch[0]


class Whereabouts(Dataset):
    """Each sample: the worker's pid and its parent's."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([os.getpid(), os.getppid()])


def test_workers_are_forked_once_with_sigterm_blocked_until_they_handle_it():
    """data.worker_options and start_workers: workers forked from this process (they share
    its memory), once for the whole run (the same two in every epoch), with SIGTERM blocked
    while they start; each then ignores a SIGTERM from anybody but this process, and ends on one
    from it: what multiprocessing's exit handler sends to daemonic children before it joins them
    (a worker ignoring every SIGTERM would hang its training process at exit)."""
    assert data.worker_options(0) == {}
    loader = DataLoader(Whereabouts(), batch_size=1, num_workers=2, **data.worker_options(2))
    data.start_workers(loader)
    epochs = [[batch[0].tolist() for batch in loader] for _ in range(2)]
    assert {parent for _, parent in epochs[0]} == {os.getpid()}
    workers = {pid for pid, _ in epochs[0]}
    assert len(workers) == 2 and workers == {pid for pid, _ in epochs[1]}
    for pid in workers:
        status = open(f"/proc/{pid}/status").read()
        blocked = int(re.search(r"^SigBlk:\s+(\w+)$", status, re.M).group(1), 16)
        assert blocked >> (signal.SIGTERM - 1) & 1  # sigwaitinfo's thread takes it
    foreign = subprocess.Popen([sys.executable, "-c", "import os, signal, sys; "
                                "[os.kill(int(p), signal.SIGTERM) for p in sys.argv[1:]]",
                                *map(str, workers)])
    foreign.wait()
    time.sleep(0.5)
    assert [batch[0].tolist() for batch in loader] and all(os.path.exists(f"/proc/{p}")
                                                           for p in workers)
    mine = [p for p in multiprocessing.active_children() if p.pid in workers]
    assert len(mine) == 2
    for p in mine:
        p.terminate()
        p.join(timeout=10)
        assert p.exitcode == 0, p.exitcode


def test_a_batched_dataset_is_passed_through_with_one_seed_per_batch():
    train, _ = common.make_datasets(args_for(None))
    dataset = data.PerSampleSeeds(train, seed=0)
    x, y = dataset.__getitems__([1, 2, 3])
    assert torch.equal(x, train.images[[1, 2, 3]])
    assert not hasattr(data.PerSampleSeeds(Draws(), 0), "__getitems__")


def test_dropout_draws_per_rank_and_again_after_a_resume():
    drop = torch.nn.Dropout(0.5)

    def mask(rank, epoch=0, step=1):
        data.seed_step(0, epoch, step, rank)
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
    dataset = Counted()
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    full = [int(i) for b in DataLoader(dataset, batch_size=8, sampler=sampler) for i in b]
    dataset.fetched.clear()
    skippable = data.Skippable(sampler)
    skippable.skip = 3 * 8  # 3 steps done
    loader = DataLoader(dataset, batch_size=8, sampler=skippable)
    rest = [[int(i) for i in b] for b in loader]
    assert sum(rest, []) == full[24:]  # the same batches as the uninterrupted epoch's
    assert rest[0] == full[24:32]
    assert sorted(dataset.fetched) == sorted(full[24:])  # nothing loaded for the first 3 steps


def test_a_last_batch_too_small_for_batchnorm_is_left_out_the_same_after_a_resume():
    """A shard of 50 in batches of 7 ends in one sample, which BatchNorm cannot normalise in
    training: every process (equal shards) leaves that batch out, so all take 7 steps; a resume
    after 3 steps trains the same 4 batches. With --accumulate 2, a last batch of 3 (micro-
    batches of 2 and 1) is left out too, one of 4 (2 and 2) is trained."""
    from torch.utils.data.distributed import DistributedSampler
    assert data.drop_last(50, 7, 1) and not data.drop_last(50, 8, 1)  # 1 left over; 2
    assert data.drop_last(51, 8, 2) and not data.drop_last(52, 8, 2)  # 3 (2 + 1); 4 (2 + 2)
    assert [len(y) for _, y, _, _ in data.micro_batches(torch.zeros(3), torch.zeros(3), 2)] \
        == [2, 1]
    assert not data.drop_last(48, 8, 4)  # nothing left over
    dataset = Counted()
    for rank in (0, 1):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=0)
        drop = data.drop_last(len(sampler), 7, 1)
        full = [b.tolist() for b in DataLoader(dataset, 7, sampler=sampler, drop_last=drop)]
        assert [len(b) for b in full] == [7] * 7
        skippable = data.Skippable(sampler)
        skippable.skip = 3 * 7
        assert [b.tolist() for b in DataLoader(dataset, 7, sampler=skippable, drop_last=drop)] \
            == full[3:]


# ---- diagnostics, ports, the resume decision, SIGTERM, the LR after a skipped step ----------

def test_an_error_line_is_one_write(monkeypatch):
    """Several ranks writing to one pipe: a line in two writes (print's text, then its newline)
    can be split by another rank's line (seen in CI). common.say writes it in one."""
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or real_write(fd, data))
    r, w = os.pipe()
    with os.fdopen(w, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)
        common.say("[rank 1] error: distributed: Unable to find address for: nosuchif0")
    with os.fdopen(r) as f:
        assert f.read() == "[rank 1] error: distributed: Unable to find address for: nosuchif0\n"
    assert [data for fd, data in writes if fd == w] == \
        [b"[rank 1] error: distributed: Unable to find address for: nosuchif0\n"]


def test_the_port_of_a_store_that_just_ended_is_free_but_a_listening_one_is_not():
    """The cause of a requeued SLURM job failing with "port ... already in use": the previous
    run's store closes its connections first, which leaves them in TIME_WAIT on its port for a
    minute. A new store binds that port all the same (its socket has SO_REUSEADDR, and so had
    the old one's); a check without the option refused it. The check is spawn_ddp.py's, in
    flags.check_args, on node 0 with --master-port."""
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
    args = args_for(None, "spawn", master_port=port)
    flags.check_args(args, None)  # the check now: the store can take it...
    again = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10))  # ...it can
    with pytest.raises(common.Fatal, match=f"port {port} is already in use"):
        flags.check_args(args, None)  # while a store listens there, the port is taken
    del again


class Payload:
    """What a checkpoint may carry besides tensors: unpickling it runs code."""

    def __reduce__(self):
        return exec, ("import builtins; builtins.payload_ran = True",)


def test_a_checkpoint_is_read_weights_only(tmp_path):
    """checkpoint.load refuses a file that holds anything but tensors and plain values, in one
    line, without running what unpickling it would run; a plain one it reads."""
    import builtins
    torch.save({"model": {}, "epoch": 1, "note": Payload()}, tmp_path / "c.pt")
    with pytest.raises(common.Fatal, match="corrupt or truncated"):
        checkpoint.load(tmp_path / "c.pt")
    assert not hasattr(builtins, "payload_ran")
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 1}, tmp_path / "c.pt")
    assert checkpoint.load(tmp_path / "c.pt")["epoch"] == 1


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """A write that fails half-way (the disk filled, here: torch.save writes half its bytes and
    raises ENOSPC) is one line, and the previous checkpoint stays as it was, with no temporary
    file beside it. (Real full disks: test_full_disk_keeps_the_previous_snapshot.)"""
    import errno
    path = tmp_path / "c.pt"
    checkpoint.save({"model": {"w": torch.zeros(1000)}, "epoch": 1}, path)
    before, save = path.read_bytes(), torch.save

    def half_then_full(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        f.seek(len(before) // 2)
        f.truncate()
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(common.Fatal, match=r"could not write the checkpoint .* \(No space left on "
                       r"device\); the previous one, if any, is intact"):
        checkpoint.save({"model": {"w": torch.ones(1000)}, "epoch": 2}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c.pt"]


def test_one_process_resumes_only_when_asked_and_found(tmp_path):
    args = argparse.Namespace(checkpoint=str(tmp_path / "c.pt"), evaluate=False, seed=0,
                              amp="none", task=None, resume=True)
    cpu, one = torch.device("cpu"), Place()
    assert checkpoint.agreed(args, checkpoint.RESUME_IF_FOUND, one, cpu) is None
    with pytest.raises(common.Fatal, match="no checkpoint at"):
        checkpoint.agreed(args, checkpoint.RESUME, one, cpu)
    torch.save({"model": {}, "epoch": 2, "step": 5, "args": {"seed": 0, "task": None}},
               args.checkpoint)
    assert checkpoint.agreed(args, checkpoint.NO_RESUME, one, cpu) is None
    assert checkpoint.agreed(args, checkpoint.RESUME_IF_FOUND, one, cpu)["step"] == 5
    task = argparse.Namespace(make_model=lambda args: torch.nn.Module())  # no parameters
    checkpoint.check_file(args, task, one)
    args.seed = 1  # another run's checkpoint: refused, unless only evaluated
    with pytest.raises(common.Fatal, match="--seed 0 in the checkpoint, 1 now"):
        checkpoint.check_file(args, task, one)
    args.evaluate = True
    checkpoint.check_file(args, task, one)
    assert checkpoint.agreed(args, checkpoint.RESUME, one, cpu)["step"] == 5
    args.task = "tasks/text.py"  # but evaluated with another task's code: refused
    with pytest.raises(common.Fatal, match=r"trained with no --task \(MNIST\), this run has "
                       "--task tasks/text.py: evaluate it with no --task"):
        checkpoint.check_file(args, task, one)


def test_sigterm_without_a_checkpoint_stops_at_once():
    stop = sigterm.StopSignal(checkpoint=None, device=torch.device("cpu"), steps=10)
    try:
        with pytest.raises(sigterm.Preempted, match="nothing saved"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between two bytecodes
                pass
    finally:
        stop.close()
    stop = sigterm.StopSignal(checkpoint="c.pt", device=torch.device("cpu"), steps=10)
    try:
        assert not stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop(2) and stop(3)  # with one: a flag, read before every step
    finally:
        stop.close()


def test_the_task_is_looked_up_when_loaded(monkeypatch, tmp_path):
    """Redefining make_model (as docs/your-own-task.md does at the end of common.py) reaches the
    checkpoint check through the loaded task: a checkpoint of the new model passes, one of Net
    does not."""
    monkeypatch.setattr(common, "make_model", lambda args: torch.nn.Linear(3, 2))
    torch.save({"model": torch.nn.Linear(3, 2).state_dict(), "epoch": 1}, tmp_path / "new.pt")
    torch.save({"model": common.Net().state_dict(), "epoch": 1}, tmp_path / "old.pt")
    task = load_task(None)
    ok = args_for(None, checkpoint=str(tmp_path / "new.pt"), resume=True)
    flags.check_args(ok, task)
    bad = args_for(None, checkpoint=str(tmp_path / "old.pt"), resume=True)
    with pytest.raises(common.Fatal, match="does not fit this model"):
        flags.check_args(bad, task)


def test_a_task_file_leaves_common_as_it_is(tmp_path):
    """--task's names reach the scripts through the task alone: common.py's stay common.py's;
    what the file leaves out is common.py's, and it prepares none of MNIST's data."""
    before = {name: getattr(common, name) for name in SEAM}
    (tmp_path / "mytask.py").write_text("import torch\n\ndef loss_fn(output, target):\n"
                                        "    return torch.tensor(7.0)\n\n"
                                        "def make_datasets(args):\n    return [], []\n")
    task = load_task(str(tmp_path / "mytask.py"))
    assert {name: getattr(common, name) for name in SEAM} == before
    assert float(task.loss_fn(None, None)) == 7 and task.make_model is common.make_model
    assert task.prepare_data is not common.prepare_data


def test_micro_batches_deal_samples_as_more_ranks_would():
    """Every tensor of a batch is dealt out, whatever the structure of the inputs."""
    x, y = {"ids": torch.arange(8) * 10, "mask": torch.arange(8) % 2}, torch.arange(8)
    parts = list(data.micro_batches(x, y, 2))
    assert [(xk["ids"].tolist(), yk.tolist(), share, last) for xk, yk, share, last in parts] == \
        [([0, 20, 40, 60], [0, 2, 4, 6], 0.5, False), ([10, 30, 50, 70], [1, 3, 5, 7], 0.5, True)]
    assert [xk["mask"].tolist() for xk, _, _, _ in parts] == [[0] * 4, [1] * 4]
    [(xk, yk, share, last)] = data.micro_batches((torch.ones(3, 2),), torch.arange(3), 1)
    assert isinstance(xk, tuple) and len(yk) == 3 and share == 1 and last
    [(xk, _, _, _), _] = data.micro_batches(Pair(torch.arange(4), torch.ones(4)), y[:4], 2)
    assert isinstance(xk, Pair) and xk.images.tolist() == [0, 2]


def test_an_argparse_namespace_is_all_a_task_needs():
    """The recipe functions take the parsed flags only (what a replaced task receives)."""
    args = argparse.Namespace(lr=0.01, batch_size=1024, lr_scaling="sqrt", epochs=2,
                              warmup_epochs=0.2)
    assert common.peak_lr(args) == pytest.approx(0.02)
    model = common.make_model(args)
    scheduler = common.make_scheduler(common.make_optimizer(model, args), args, 10)
    assert scheduler.get_last_lr()[0] < common.peak_lr(args)  # warming up


@pytest.mark.parametrize("batch,rule,lr", [(64, "sqrt", 0.01), (192, "linear", 0.01),
                                           (1024, "sqrt", 0.02), (64, "none", 0.003)])
def test_peak_lr_follows_the_rule(batch, rule, lr, capsys):
    """The schedule of 2 epochs of the tiny MNIST (600 samples) at that global batch, step by
    step, with the scripts' own parser and recipe: its peak is --lr times the rule's factor of
    batch / 256, reached after a warmup that starts below it. (What a real run's optimizer
    gets: test_every_process_steps_with_the_lr_it_says.) The run's line says that peak."""
    args = flags.parse_args("", "dp", ["--dummy", "--epochs", "2", "--batch-size", str(batch),
                                       "--lr", str(lr), "--lr-scaling", rule])
    peak = lr * {"sqrt": (batch / 256) ** 0.5, "linear": batch / 256, "none": 1.0}[rule]
    assert common.peak_lr(args) == pytest.approx(peak, rel=1e-12)
    steps = -(-600 // batch)
    optimizer = common.make_optimizer(common.make_model(args), args)
    scheduler = common.make_scheduler(optimizer, args, steps)
    lrs = []
    for _ in range(2 * steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert max(lrs) == pytest.approx(peak, rel=1e-12) and (lrs[0] < peak or len(lrs) <= 2)
    reporting.Reporter(args, Place(), torch.device("cpu")).start(0, 0, steps, optimizer)
    assert f"LR {lr:g} at batch 256 -> {peak:.4g} at {batch} (" in capsys.readouterr().out


def test_a_task_of_its_own_recipe_gets_its_own_lr_line(capsys):
    """A task whose make_optimizer ignores --lr (SGD at 0.05): its LR, not MNIST's rule."""
    args = flags.parse_args("", "dp", ["--dummy", "--batch-size", "128"])
    sgd = torch.optim.SGD(common.make_model(args).parameters(), lr=0.05)
    common.make_scheduler(sgd, args, 10)  # starts below 0.05: the warmup
    reporting.Reporter(args, Place(), torch.device("cpu")).start(0, 0, 10, sgd)
    out = capsys.readouterr().out
    assert "LR 0.05: the task's own SGD recipe (--lr and --lr-scaling do not set it)" in out
    assert "rule" not in out


def test_a_run_of_one_step_steps_its_schedule():
    """One epoch of one step (the whole training set in one global batch): the warmup is that
    step, and the schedule's step after it ends at 0, where it divided 0 by 0."""
    args = argparse.Namespace(lr=0.01, batch_size=256, lr_scaling="sqrt", epochs=1,
                              warmup_epochs=0.2)
    optimizer = common.make_optimizer(common.make_model(args), args)
    scheduler = common.make_scheduler(optimizer, args, 1)
    assert scheduler.get_last_lr() == [0.01]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.0]


def test_an_exception_in_a_few_words():
    """common.reason, in every one-line error: the type, and a line of the message if any."""
    assert common.reason(AssertionError()) == "AssertionError"  # torchvision's bare asserts
    assert common.reason(ValueError("\n  first\nsecond")) == "ValueError: first"
    assert common.reason(RuntimeError("Tried a, got:\nno route"), -1) == "RuntimeError: no route"


def test_tensorboard_curves_go_on_after_a_resume_each_step_once(tmp_path, capsys):
    """--tensorboard through the scripts' Reporter: a run that logged steps 1-8 and died after
    its snapshot at step 5, then the run resumed from that snapshot into the same folder (new
    values from step 6): TensorBoard reads every step once, in order, the first run's up to the
    snapshot and the resumed run's after it; each epoch's numbers are --metrics' (float32 in
    the file), at the epoch's last step; --evaluate writes nothing."""
    args = flags.parse_args("", "spawn", ["--dummy", "--epochs", "2", "--tensorboard",
                                          str(tmp_path / "tb"), "--metrics",
                                          str(tmp_path / "m.jsonl")])
    stats = argparse.Namespace(seen=1, start=time.perf_counter())
    optimizer = common.make_optimizer(common.make_model(args), args)
    first = reporting.Reporter(args, Place(), torch.device("cpu"))
    first.start(0, 0, 10, optimizer)
    for step in range(1, 9):
        first.progress(0, step, 10, float(step), 0.01, stats)
    second = reporting.Reporter(args, Place(), torch.device("cpu"))  # no close: killed
    second.start(0, 5, 10, optimizer)
    for step in range(6, 11):
        second.progress(0, step, 10, 100.0 + step, 0.01, stats)
    second.record(epoch=1, train_loss=0.1234567, test_acc=97.5, partial="steps 6-10 of 10")
    curves = read_tensorboard(tmp_path / "tb")
    assert curves["step/train_loss"] == [(s, s if s <= 5 else 100.0 + s) for s in range(1, 11)]
    [row] = read_metrics(tmp_path / "m.jsonl")
    for key in ("train_loss", "test_acc", "world_size"):
        assert curves[f"epoch/{key}"] == [(10, torch.tensor(row[key]).float().item())], key
    assert not [t for t in curves if t.endswith(("/epoch", "/partial"))]
    args.evaluate = True
    evaluation = reporting.Reporter(args, Place(), torch.device("cpu"))
    evaluation.start(1, 0, 10, optimizer)
    evaluation.record(epoch=1, evaluate=True, test_acc=97.5)
    assert len(list((tmp_path / "tb").iterdir())) == 2  # the two runs' event files
    assert "LR " not in capsys.readouterr().out.split("task common.py")[-1]  # --evaluate's


def test_a_checkpoint_fitted_on_the_meta_device_still_loads_into_the_optimizers_parameters(
        tmp_path):
    """The check before the meeting fits the checkpoint to a meta-device model (assign=True);
    torch notes that in the dict's _metadata, and a later plain load of the same dict would
    replace the model's parameters, leaving the optimizer's untrained (pytorch/pytorch#188166).
    The resume loads that same dict (read once): it must copy into the existing parameters."""
    path = tmp_path / "c.pt"
    torch.save({"model": common.Net().state_dict()}, path)
    state = checkpoint.load(path)["model"]
    with torch.device("meta"):
        checkpoint.load_model_state(common.Net(), state, path, assign=True)
    model = common.Net()
    params = list(model.parameters())
    checkpoint.load_model_state(model, state, path)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(torch.equal(p, state[k]) for k, p in model.named_parameters())


def test_the_first_step_names_parameters_without_a_gradient_under_ddp():
    """The task's optimizer (load_task wraps make_optimizer) checks its first step: under the
    DDP scripts without --find-unused-parameters, a parameter without a gradient is named in
    one line before anything is updated; with the flag, or in scripts without it (FSDP2,
    DataParallel), the step goes on."""
    task = load_task(None)
    for flag, refused in ((False, True), (True, False), (None, False)):
        args = flags.parse_args("", "spawn" if flag is not None else "fsdp", ["--dummy"] + (
            ["--find-unused-parameters"] if flag else []))
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 1), "spare": torch.nn.Linear(2, 1)})
        optimizer = task.make_optimizer(model, args)
        model["used"](torch.ones(3, 2)).sum().backward()
        before = model["used"].weight.detach().clone()
        if refused:
            with pytest.raises(common.Fatal, match=r"^the model's spare\.weight, spare\.bias got no "
                               r"gradient in the first step .*--find-unused-parameters"):
                optimizer.step()
            assert torch.equal(model["used"].weight, before)  # nothing updated
        else:
            optimizer.step()
            assert not torch.equal(model["used"].weight, before)
        optimizer.step()  # the check runs once: a second step goes on either way


def test_a_checkpoint_path_has_one_spelling():
    """A shell completes a link to a folder with "/" (torchrun_fsdp.py's DCP link), and
    os.path.islink("snap/") follows the link: --checkpoint is normalised where it is read, so
    "snap/", "./snap" and "snap" are one checkpoint (test_fsdp.py's killed worker runs with
    "snap/")."""
    for given in ("snap/", "./snap", "snap", "runs//snap/"):
        args = flags.parse_args("", "fsdp", ["--dummy", "--checkpoint", given])
        assert args.checkpoint == os.path.normpath(given) and not args.checkpoint.endswith("/")
    assert flags.parse_args("", "fsdp", ["--dummy", "--checkpoint", "snap/"]).checkpoint == "snap"
