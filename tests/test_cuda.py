"""The scripts on GPUs: NCCL, one GPU per process, fp16 with a GradScaler (and a forced
overflow), bf16, channels_last, SyncBatchNorm, DataParallel over every GPU, checkpoints that move
between GPU and CPU. Every test is marked `cuda` and skips, saying why, where torch sees no GPU;
those that need two GPUs skip on one. Run them with `python -m pytest -m cuda`; see
docs/maintainers.md#gpu-tests. They launch the real scripts as subprocesses
(conftest.run_script); this process reads their checkpoints with map_location="cpu" and
allocates nothing on a GPU.

Written on a machine without a GPU; the one-GPU tests first ran on an H200 on 2026-11-26
(../shared/gpu-runs/2026-11-26-h200/), the two-GPU tests not yet.

What the GPU runs report comes from tests/instrument/sitecustomize.py: DDP_TEST_GPU_RECORD
(contexts and memory per GPU and module output dtypes, per process, at exit) and
DDP_TEST_INF_GRAD_STEP (an infinite gradient on one chosen step)."""
import math
import re
import sys

import pytest
import torch

import conftest
from conftest import N_TEST, ROOT, load_on_cpu, optimizer_steps, read_metrics, read_records, \
    storage_locations

sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from ddpkit import machine  # noqa: E402


def run_script(*args, **kwargs):
    """conftest.run_script with the GPUs visible (the CPU tests hide them); a test that wants a
    CPU-only run passes CUDA_VISIBLE_DEVICES="" itself."""
    return conftest.run_script(*args, gpus=True, **kwargs)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU: torch.cuda.is_available() "
                                 "is False on this machine")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, torch sees {GPUS}")

DDP_SCRIPTS = ["spawn_ddp.py", "torchrun_ddp.py", "apex_ddp.py"]
TORCHRUN = ("-m", "torch.distributed.run", "--standalone")  # the `torchrun` command
STEPS = 10  # per epoch: conftest's 600 training images in global batches of 64
CONV = "torch.nn.modules.conv.Conv2d"


def launch(script, nproc, data, *args, amp="none", **kw):
    """One run of `script` on the tiny MNIST with `nproc` processes (spawn_ddp.py spawns them,
    torchrun starts the others; dp_baseline.py is always one process over all its GPUs).
    apex_ddp.py runs its native path (--native): --opt-level O0 for fp32, O1 for fp16."""
    flags = ["--data-dir", data, "--batch-size", 64, "--log-interval", 5, *args]
    if script != "dp_baseline.py":  # one process has no peers to wait for: no --timeout
        flags = ["--timeout", 60, *flags]
    kw.setdefault("timeout", 300)  # CUDA and NCCL start-up can take tens of seconds
    if script == "apex_ddp.py":
        flags += ["--native", "--opt-level", {"none": "O0", "fp16": "O1"}[amp]]
    else:  # said even for fp32: the default, --amp auto, is bf16 on a GPU that computes it
        flags += ["--amp", amp]
    if script == "spawn_ddp.py":
        return run_script(script, "--nproc-per-node", nproc, *flags, **kw)
    if script == "dp_baseline.py":
        assert nproc == 1, "DataParallel is one process"
        return run_script(script, *flags, **kw)
    return run_script(script, *flags, launcher=(*TORCHRUN, f"--nproc-per-node={nproc}"), **kw)


def record_dir(tmp_path, name="gpu"):
    d = tmp_path / name
    d.mkdir()
    return d


def workers(rec):
    """The GPU records of the processes that joined a process group (DataParallel: of the one
    process that ran the model), sorted by rank."""
    rows = read_records(rec, "gpu")
    for row in rows:
        assert "error" not in row, row
    return sorted((r for r in rows if r["rank"] is not None or "common.Net" in r["modules"]),
                  key=lambda r: r["rank"] or 0)


def assert_trained(metrics, epochs, world_size):
    rows = read_metrics(metrics)
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))
    assert all(r["world_size"] == world_size and r["total"] == N_TEST for r in rows)
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    if epochs > 1:
        assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_acc"] > 80, rows
    return rows


def assert_plain_checkpoint(path, written_on):
    """Saved from `written_on` (e.g. "cuda:0"), no "module." prefix, loads into common.Net."""
    gpus = {loc for loc in storage_locations(path) if loc != "cpu"}  # Adam's step counts stay
    assert gpus == ({written_on} if written_on != "cpu" else set())  # on the CPU in any run
    ckpt = load_on_cpu(path)
    common.Net().load_state_dict(ckpt["model"])  # strict: every key, no "module." prefix
    return ckpt


def evaluate(data, ckpt, metrics, *flags, script="spawn_ddp.py", **env):
    """--evaluate with one process, without the training flags (but `flags`); returns the
    correct count."""
    extra = ("--nproc-per-node", 1) if script == "spawn_ddp.py" else ()
    r = run_script(script, "--data-dir", data, *extra, *flags, "--evaluate", "--checkpoint", ckpt,
                   "--metrics", metrics, timeout=300, **env)
    [row] = read_metrics(metrics)
    assert row["total"] == N_TEST and row["evaluate"]
    return row["correct"], r


# ---- every launch style on NCCL ------------------------------------------------------------

@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
@pytest.mark.parametrize("script", DDP_SCRIPTS)
def test_ddp_scripts_train_on_nccl(script, nproc, tiny_mnist, tmp_path):
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    r = launch(script, nproc, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt,
               "--metrics", metrics, DDP_TEST_GPU_RECORD=rec)
    assert f"{nproc} processes" in r.stdout and "backend nccl, device cuda" in r.stdout
    if script == "apex_ddp.py":
        [path] = [ln for ln in r.stdout.splitlines() if ln.startswith("path: ")]
        assert path.startswith("path: native PyTorch (--native)") and "fp32" in path, path
    assert_trained(metrics, 2, nproc)
    assert assert_plain_checkpoint(ckpt, "cuda:0")["epoch"] == 2  # written by rank 0, on GPU 0
    ws = workers(rec)
    assert [w["rank"] for w in ws] == list(range(nproc))
    for w in ws:
        assert w["device"] == w["rank"]  # rank r on GPU r
        assert f"{CONV} float32" in w["outputs"] and f"{CONV} float16" not in w["outputs"]
        if script == "spawn_ddp.py":  # its share of the cores, as on a CPU (torchrun: 1)
            assert w["threads"] == max(1, machine.cpu_count() // nproc), w


def test_dataparallel_uses_every_visible_gpu(tiny_mnist, tmp_path):
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    r = launch("dp_baseline.py", 1, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt,
               "--metrics", metrics, DDP_TEST_GPU_RECORD=rec)
    assert f"DataParallel over GPU(s) {list(range(GPUS))}, gathering on cuda:0" in r.stdout
    assert_trained(metrics, 2, 1)
    assert_plain_checkpoint(ckpt, "cuda:0")
    [proc] = workers(rec)
    assert "torch.nn.parallel.data_parallel.DataParallel" in proc["modules"]
    assert proc["contexts"] == [True] * GPUS  # a replica on every GPU ...
    assert all(m > 0 for m in proc["max_allocated"]), proc  # ... that really computed there


@two_gpus
def test_dataparallel_on_a_chosen_gpu_stays_on_it(tiny_mnist, tmp_path):
    last = GPUS - 1
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    r = launch("dp_baseline.py", 1, tiny_mnist, "--gpus", last, "--checkpoint", ckpt,
               "--metrics", metrics, DDP_TEST_GPU_RECORD=rec)
    assert f"DataParallel over GPU(s) [{last}], gathering on cuda:{last}" in r.stdout
    assert_trained(metrics, 1, 1)
    assert_plain_checkpoint(ckpt, f"cuda:{last}")
    [proc] = workers(rec)
    assert proc["contexts"] == [i == last for i in range(GPUS)], proc
    assert [m > 0 for m in proc["max_allocated"]] == [i == last for i in range(GPUS)], proc


@two_gpus
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_dataparallel_replicas_compute_in_the_jobs_precision(amp, tiny_mnist, tmp_path):
    """DataParallel's replica threads enter autocast without a dtype, float16 on a GPU
    (test_precision.py shows why on a CPU); machine.Autocast gives each replica the job's.
    bf16: every replica's convolutions in bfloat16 and none in float16, no scaler; fp16: in
    float16, with the GradScaler's state saved."""
    if amp == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU does not compute bfloat16")
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    launch("dp_baseline.py", 1, tiny_mnist, "--checkpoint", ckpt, "--metrics", metrics, amp=amp,
           DDP_TEST_GPU_RECORD=rec)
    assert_trained(metrics, 1, 1)
    [proc] = workers(rec)
    assert all(m > 0 for m in proc["max_allocated"]), proc  # every GPU computed
    dtypes = {"bf16": "bfloat16", "fp16": "float16"}
    assert f"{CONV} {dtypes[amp]}" in proc["outputs"], proc["outputs"]
    assert f"{CONV} {dtypes['fp16' if amp == 'bf16' else 'bf16']}" not in proc["outputs"]
    assert bool(load_on_cpu(ckpt)["scaler"]) == (amp == "fp16")


DROPOUT_TASK = """
import json as _json
import os as _os


class _Dropped(nn.Module):
    \"\"\"common.Net after a dropout mask of 64 draws, written to $MASKS at each training
    forward with the GPU that drew it.\"\"\"

    def __init__(self):
        super().__init__()
        self.net, self.drop = Net(), nn.Dropout(0.5)

    def forward(self, x):
        if self.training and torch.is_grad_enabled():  # training steps only
            mask = self.drop(torch.ones(64, device=x.device)) > 0
            with open(_os.environ["MASKS"], "a") as f:
                f.write(_json.dumps({"gpu": x.device.index, "mask": mask.int().tolist()}) + "\\n")
        return self.net(x)


def make_model(args):
    return _Dropped()
"""


@two_gpus
def test_dataparallel_replicas_draw_their_own_dropout(tiny_mnist, tmp_path):
    """Each step reseeds every GPU's generator (data.seed_step); seeded alike, the two
    replicas would draw the same dropout masks for their halves of the batch."""
    import json
    repo, masks = conftest.with_task(tmp_path / "repo", DROPOUT_TASK), tmp_path / "masks.jsonl"
    launch("dp_baseline.py", 1, tiny_mnist, "--gpus", "0,1", repo=repo, MASKS=masks)
    rows = [json.loads(line) for line in masks.read_text().splitlines()]
    drawn = {gpu: [r["mask"] for r in rows if r["gpu"] == gpu] for gpu in (0, 1)}
    assert len(drawn[0]) == len(drawn[1]) == STEPS, rows
    assert all(a != b for a, b in zip(drawn[0], drawn[1])), rows


# ---- mixed precision -------------------------------------------------------------------------

@pytest.mark.parametrize("script,nproc,rank", [
    *[(s, 1, None) for s in [*DDP_SCRIPTS, "dp_baseline.py"]],
    # the overflow in one process only: DDP's all-reduce must carry it to the other, so that
    # both skip the same step and stay identical
    pytest.param("spawn_ddp.py", 2, 1, marks=two_gpus),
    pytest.param("torchrun_ddp.py", 2, 1, marks=two_gpus)])
def test_fp16_overflow_skips_the_step_and_the_schedule_waits(script, nproc, rank, tiny_mnist,
                                                              tmp_path):
    """fp16 autocast + GradScaler, with an infinite gradient forced on step 13 (the third of
    epoch 2). The scaler skips that optimizer step and halves its scale; the script must then
    not step the LR schedule either, so the scheduler has counted exactly the optimizer's
    steps. Steps that overflow by themselves (early, while the scale is high) are allowed:
    every check counts skips from the checkpoint instead of assuming there is exactly one."""
    inf_at, total = STEPS + 3, 2 * STEPS
    env = {"DDP_TEST_INF_GRAD_STEP": inf_at}
    if rank is not None:
        env["DDP_TEST_INF_GRAD_RANK"] = rank
    rec, replicas = record_dir(tmp_path), record_dir(tmp_path, "replicas")
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    r = launch(script, nproc, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt, "--metrics", metrics,
               amp="fp16", record=replicas, DDP_TEST_GPU_RECORD=rec, **env)
    assert r.stderr.count("test instrumentation: infinite gradient") == 1, r.stderr
    assert_trained(metrics, 2, nproc)  # the loss values stay finite: only the gradient overflowed

    ckpt = load_on_cpu(ckpt)
    steps = optimizer_steps(ckpt)
    skipped = total - steps
    assert skipped >= 1  # the forced overflow was skipped
    assert ckpt["scheduler"]["last_epoch"] == steps  # the schedule advanced with the optimizer,
    assert ckpt["scheduler"]["_step_count"] == steps + 1  # not with the loop
    assert ckpt["scheduler"]["_last_lr"] == [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
    # the scale halves on each skip and would grow only after 2000 clean steps
    assert ckpt["scaler"]["scale"] == 2.0 ** 16 * 0.5 ** skipped
    assert ckpt["scaler"]["_growth_tracker"] <= total - inf_at  # the last skip: step 13 or later
    for w in workers(rec):
        assert f"{CONV} float16" in w["outputs"]  # autocast really ran the convolutions in fp16
    if nproc > 1:  # both processes skipped the same step: their models are still identical
        a, b = (load_on_cpu(replicas / f"final-rank{i}.pt") for i in (0, 1))
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py", "dp_baseline.py"])
def test_bf16_autocast_needs_no_scaler(script, tiny_mnist, tmp_path):
    """apex_ddp.py has no bf16 on GPUs: its native path maps O1-O3 to fp16 there."""
    # asked here, not at import: the question gives this process a context on GPU 0
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU does not support bfloat16 (torch.cuda.is_bf16_supported())")
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    launch(script, 1, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt, "--metrics", metrics,
           amp="bf16", DDP_TEST_GPU_RECORD=rec)
    assert_trained(metrics, 2, 1)
    ckpt = load_on_cpu(ckpt)
    assert ckpt["scaler"] == {}  # GradScaler disabled: nothing to save
    assert optimizer_steps(ckpt) == ckpt["scheduler"]["last_epoch"] == 2 * STEPS  # none skipped
    [w] = workers(rec)
    assert f"{CONV} bfloat16" in w["outputs"] and f"{CONV} float16" not in w["outputs"]


# ---- memory format and SyncBatchNorm ---------------------------------------------------------

@pytest.mark.parametrize("script,nproc", [("spawn_ddp.py", 1),
                                          pytest.param("spawn_ddp.py", 2, marks=two_gpus),
                                          ("dp_baseline.py", 1)])
def test_channels_last_on_gpu(script, nproc, tiny_mnist, tmp_path):
    """NHWC weights with fp16: no DDP warning about gradient strides, weights saved as they
    are, and the checkpoint evaluates the same in NCHW (--no-channels-last)."""
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    r = launch(script, nproc, tiny_mnist, "--channels-last", "--checkpoint", ckpt,
               "--metrics", metrics, amp="fp16")
    assert "stride" not in r.stderr.lower()  # DDP warns when grads and buckets differ in layout
    [trained] = assert_trained(metrics, 1, nproc)
    w = assert_plain_checkpoint(ckpt, "cuda:0")["model"]["features.4.weight"]  # 16 channels in
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    correct, _ = evaluate(tiny_mnist, ckpt, tmp_path / "eval.jsonl", "--no-channels-last")
    assert correct == trained["correct"]


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
@pytest.mark.parametrize("script", DDP_SCRIPTS)
def test_sync_bn_converts_trains_and_saves_a_plain_model(script, nproc, tiny_mnist, tmp_path):
    rec, ckpt, metrics = record_dir(tmp_path), tmp_path / "c.pt", tmp_path / "m.jsonl"
    launch(script, nproc, tiny_mnist, "--sync-bn", "--epochs", 2, "--checkpoint", ckpt,
           "--metrics", metrics, DDP_TEST_GPU_RECORD=rec)
    for w in workers(rec):  # every BatchNorm2d was replaced before training
        assert "torch.nn.modules.batchnorm.SyncBatchNorm" in w["modules"]
        assert "torch.nn.modules.batchnorm.BatchNorm2d" not in w["modules"]
    rows = assert_trained(metrics, 2, nproc)
    assert_plain_checkpoint(ckpt, "cuda:0")  # SyncBatchNorm's keys are BatchNorm2d's
    correct, _ = evaluate(tiny_mnist, ckpt, tmp_path / "eval.jsonl")  # plain BatchNorm2d
    assert correct == rows[-1]["correct"]


# ---- refusals ----------------------------------------------------------------------------------
# spawn_ddp.py --nproc-per-node GPUS+1: tests/test_spawn_ddp.py::test_error_more_processes_than_gpus
# (not marked `cuda`: it runs in the plain suite wherever there is a GPU).

@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_fsdp_trains_resumes_and_converts_on_gpus(amp, nproc, tiny_mnist, tmp_path):
    """torchrun_fsdp.py on NCCL (written without a GPU: docs/fsdp.md): with MixedPrecisionPolicy
    in bf16 and without, stopped after epoch 1, the same command continues from its DCP folder
    written from CUDA, and torch's converter makes it, on the CPU, a plain state dict that
    common.py's model loads. One process shards nothing but runs every path but the gathers."""
    flags = ("--epochs", 2, "--checkpoint", tmp_path / "snap", "--metrics", tmp_path / "m.jsonl")
    launch("torchrun_fsdp.py", nproc, tiny_mnist, *flags, "--stop-after", 1, amp=amp)
    rec = record_dir(tmp_path)
    r = launch("torchrun_fsdp.py", nproc, tiny_mnist, *flags, amp=amp, DDP_TEST_GPU_RECORD=rec)
    assert "backend nccl, device cuda" in r.stdout and "1 epoch(s) + 0 step(s)" in r.stdout
    assert [row["epoch"] for row in read_metrics(tmp_path / "m.jsonl")] == [1, 2]
    common.Net().load_state_dict(conftest.load(tmp_path / "snap")["model"])  # strict
    for w in workers(rec):  # what the lease reports: the dtypes the policy computed in, and
        print(f"rank {w['rank']} --amp {amp}: peak {max(w['max_allocated']) / 2**20:.1f} MiB; "
              f"outputs {w['outputs']}")  # the peak memory (torch.cuda.max_memory_allocated)
        dtype = {"none": "float32", "bf16": "bfloat16"}[amp]
        assert f"{CONV} {dtype}" in w["outputs"], w["outputs"]


@pytest.mark.parametrize("script", ["torchrun_ddp.py", "apex_ddp.py"])
def test_more_processes_than_gpus_is_refused(script, tiny_mnist):
    n = GPUS + 1
    r = run_script(script, "--data-dir", tiny_mnist, launcher=(*TORCHRUN, f"--nproc-per-node={n}"),
                   check=False, timeout=180)
    assert r.returncode != 0
    assert f"error: --nproc-per-node {n} but this machine has {GPUS} GPU(s)" in r.stderr


def test_dataparallel_refuses_a_gpu_that_is_not_there(tiny_mnist):
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--gpus", f"0,{GPUS}",
                   check=False, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"this machine has {GPUS} GPU(s)" in lines[0]


# ---- checkpoints between GPU and CPU -------------------------------------------------------------

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # what a CPU-only machine looks like to torch


def test_gpu_checkpoint_evaluates_and_resumes_on_a_cpu(tiny_mnist, tmp_path):
    """Written on GPU 0 with fp16 (so with a GradScaler state); read where CUDA is hidden."""
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    launch("spawn_ddp.py", 1, tiny_mnist, "--epochs", 2, "--stop-after", 1, "--checkpoint", ckpt,
           "--metrics", metrics, amp="fp16")
    [trained] = assert_trained(metrics, 1, 1)
    assert_plain_checkpoint(ckpt, "cuda:0")
    correct, r = evaluate(tiny_mnist, ckpt, tmp_path / "eval.jsonl", **NO_GPU)
    assert "backend gloo, device cpu" in r.stdout
    assert correct == trained["correct"]
    r = launch("spawn_ddp.py", 1, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt, "--resume",
               "--metrics", metrics, amp="fp16", **NO_GPU)
    assert "device cpu" in r.stdout and "1 epoch(s) + 0 step(s)" in r.stdout
    assert_trained(metrics, 2, 1)  # epoch 1 on the GPU, epoch 2 on the CPU
    resumed = assert_plain_checkpoint(ckpt, "cpu")
    assert resumed["epoch"] == 2 and resumed["scaler"]["scale"] > 0


@pytest.mark.parametrize("evaluator", ["spawn_ddp.py", "dp_baseline.py"])
def test_cpu_checkpoint_evaluates_and_resumes_on_a_gpu(evaluator, tiny_mnist, tmp_path):
    ckpt, metrics = tmp_path / "c.pt", tmp_path / "m.jsonl"
    launch("spawn_ddp.py", 1, tiny_mnist, "--epochs", 2, "--stop-after", 1, "--checkpoint", ckpt,
           "--metrics", metrics, **NO_GPU)
    [trained] = assert_trained(metrics, 1, 1)
    assert_plain_checkpoint(ckpt, "cpu")
    correct, r = evaluate(tiny_mnist, ckpt, tmp_path / "eval.jsonl", script=evaluator)
    assert "device cuda" in r.stdout or "DataParallel over GPU(s)" in r.stdout
    assert correct == trained["correct"]
    launch(evaluator, 1, tiny_mnist, "--epochs", 2, "--checkpoint", ckpt, "--resume",
           "--metrics", metrics)
    assert_trained(metrics, 2, 1)  # epoch 1 on the CPU, epoch 2 on the GPU
    assert assert_plain_checkpoint(ckpt, "cuda:0")["epoch"] == 2


def test_spawn_takes_the_visible_gpus_only(tiny_mnist, tmp_path):
    """CUDA_VISIBLE_DEVICES chooses the GPUs (docs/clusters.md#choosing-gpus): with the last GPU
    alone visible, spawn_ddp.py's default starts one process, on it; with none visible, it
    trains on the CPU over gloo. (Issue 60; written without a GPU.)"""
    rec = record_dir(tmp_path)
    r = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--batch-size", 64, "--epochs", 1,
                   "--amp", "none", timeout=300, CUDA_VISIBLE_DEVICES=str(GPUS - 1),
                   DDP_TEST_GPU_RECORD=rec)
    assert "1 processes" in r.stdout and "backend nccl, device cuda" in r.stdout, r.stdout
    [w] = workers(rec)
    assert (w["device"], w["contexts"]) == (0, [True]), w  # the one it sees: GPU GPUS-1
    r = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--batch-size", 64, "--epochs", 1,
                   "--nproc-per-node", 2, timeout=300, CUDA_VISIBLE_DEVICES="")
    assert "backend gloo, device cpu" in r.stdout, r.stdout


def test_deterministic_runs_are_bit_identical_on_a_gpu(tiny_mnist, tmp_path):
    """--deterministic on CUDA (docs/training.md#--deterministic): torch's deterministic
    algorithms (it raises for an op that has none), cuDNN's deterministic kernels, no
    autotuning, cuBLAS's workspace: the same command twice gives the same weights, bit for bit,
    through convolutions, max-pooling, BatchNorm and the loss. (Issue 60; written without a
    GPU: whether an op of these raises for want of a deterministic kernel is what it shows.)"""
    for name in ("a", "b"):
        launch("spawn_ddp.py", 1, tiny_mnist, "--epochs", 1, "--deterministic", "--checkpoint",
               tmp_path / f"{name}.pt")
    a, b = (load_on_cpu(tmp_path / f"{n}.pt")["model"] for n in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


# ---- one GPU per process -----------------------------------------------------------------------

@two_gpus
@pytest.mark.parametrize("script", DDP_SCRIPTS)
def test_no_process_but_rank_r_uses_gpu_r(script, tiny_mnist, tmp_path):
    """The classic "extra processes on GPU 0": a torch.load without map_location, or a CUDA
    call before set_device, gives every rank a context (and memory) on GPU 0. Checked for a
    training run, a resume (every rank loads the checkpoint) and an evaluation, each with 2
    processes: rank r holds a context and memory on GPU r and nowhere else, and the launching
    processes (spawn's parent, torchrun's agent, helpers) hold none at all."""
    ckpt = tmp_path / "c.pt"
    runs = {"train": ["--epochs", 2, "--stop-after", 1],
            "resume": ["--epochs", 2, "--resume"],  # torchrun/apex: implied by the file's existence
            "evaluate": ["--evaluate"]}
    for name, args in runs.items():
        rec = record_dir(tmp_path, name)
        launch(script, 2, tiny_mnist, *args, "--checkpoint", ckpt, amp="fp16",
               DDP_TEST_GPU_RECORD=rec)
        rows = read_records(rec, "gpu")
        assert sorted(r["rank"] for r in rows if r["rank"] is not None) == [0, 1], (name, rows)
        for row in rows:
            assert "error" not in row, (name, row)
            if row["rank"] is None:
                assert not any(row["contexts"]), (name, row)
                continue
            mine = [i == row["rank"] for i in range(GPUS)]
            assert row["device"] == row["rank"], (name, row)
            assert row["contexts"] == mine, (name, row)
            assert [m > 0 for m in row["max_allocated"]] == mine, (name, row)
            assert [m > 0 for m in row["reserved"]] == mine, (name, row)


# ---- safe on a GPU cluster (docs/clusters.md#before-your-first-multi-node-gpu-job) -----------

@two_gpus
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_each_rank_binds_the_group_to_its_own_gpu(script, tiny_mnist, tmp_path):
    """init_process_group(device_id=...): NCCL's first collective uses rank r's GPU, not one
    it guesses (rank % visible GPUs on older torch)."""
    rec = record_dir(tmp_path)
    launch(script, 2, tiny_mnist, DDP_TEST_GPU_RECORD=rec)
    rows = [r for r in read_records(rec, "gpu") if r["rank"] is not None]
    assert sorted((r["rank"], r["device_id"]) for r in rows) == [(0, "cuda:0"), (1, "cuda:1")]


@two_gpus
def test_the_stop_agreement_runs_on_nccl_and_resumes_bit_identical(tiny_mnist, tmp_path):
    """SIGTERM to every process in the middle of an epoch on 2 GPUs: the one-number agreement
    runs on NCCL (no gloo group is made), both stop at one step with a snapshot, and the resume
    ends as a run never interrupted."""
    straight, stopped, rec = tmp_path / "straight.pt", tmp_path / "stopped.pt", tmp_path / "rec"
    rec.mkdir()
    flags = ["--data-dir", tiny_mnist, "--nproc-per-node", 2, "--batch-size", 32, "--epochs", 2,
             "--log-interval", 1, "--timeout", 60]
    run_script("spawn_ddp.py", *flags, "--checkpoint", straight, timeout=300)
    cmd = [sys.executable, str(ROOT / "spawn_ddp.py"), *map(str, flags), "--checkpoint",
           str(stopped)]
    err = conftest.sigterm_when(cmd, "epoch 1/2 step 4/",
                                conftest.script_env(record=rec, gpus=True), cwd=tmp_path).stderr
    assert "preempted: stopped on SIGTERM after step" in err, err
    assert not read_records(rec, "group")  # NCCL's group alone
    assert load_on_cpu(stopped)["step"] >= 4
    run_script("spawn_ddp.py", *flags, "--checkpoint", stopped, "--resume", timeout=300)
    conftest.assert_same_training_state(load_on_cpu(straight), load_on_cpu(stopped))


@pytest.mark.skipif(GPUS > 0 and torch.cuda.is_bf16_supported(including_emulation=False),
                    reason="this GPU computes bfloat16: the warning is for GPUs before Ampere")
def test_bf16_on_a_gpu_without_it_is_said(tiny_mnist):
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--amp", "bf16", "--epochs", 1,
                   timeout=300)
    assert "warning: --amp bf16 on this GPU is slower than fp32" in r.stderr, r.stderr


@pytest.mark.skipif(GPUS > 0 and not torch.cuda.is_bf16_supported(including_emulation=False),
                    reason="this GPU lacks bfloat16: test_bf16_on_a_gpu_without_it_is_said")
def test_bf16_on_a_gpu_with_it_says_nothing(tiny_mnist):
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--amp", "bf16", "--epochs", 1,
                   timeout=300)
    assert "warning" not in r.stderr, r.stderr


@two_gpus
def test_a_rank_that_fails_alone_ends_the_others_at_once_on_nccl(tiny_mnist, tmp_path):
    """Rank 0's second checkpoint write fails (a full disk, simulated): it says so in one line,
    destroys its process group and exits 2; rank 1, waiting at the barrier after the save, fails
    at once instead of waiting out --timeout (300 s here)."""
    import time
    start = time.monotonic()
    r = launch("spawn_ddp.py", 2, tiny_mnist, "--epochs", 2, "--timeout", 300, "--checkpoint",
               tmp_path / "c.pt", check=False, DDP_TEST_FAIL_SAVE=2)
    assert time.monotonic() - start < 150, r.stderr
    assert "could not write the checkpoint" in r.stderr and r.returncode != 0, r.stderr


def test_amp_auto_is_bf16_where_the_gpu_computes_it_and_fp32_elsewhere(tiny_mnist, tmp_path):
    """The default precision on this GPU, said at start and recorded in the checkpoint."""
    r = run_script("dp_baseline.py", "--data-dir", tiny_mnist, "--epochs", 1, "--checkpoint",
                   tmp_path / "c.pt", timeout=300)
    fast, name = torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name()
    said = f"bf16 autocast, as the {name} computes" if fast else f"fp32, as the {name} has no"
    assert f"precision: {said}" in r.stdout, r.stdout
    assert load_on_cpu(tmp_path / "c.pt")["args"]["amp"] == ("bf16" if fast else "none")


# ---- a GPU cluster's first job: start-up, precision, errors (docs/clusters.md) --------------

@two_gpus
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_a_late_rank_starts_on_nccl_within_the_timeout(script, tiny_mnist, tmp_path):
    """Rank 1 reaches init_process_group 20 s after rank 0 (as a node still preparing its data
    would), with --join-timeout 5: NCCL's unique id goes through the store that
    init_process_group got, which now waits --timeout (120 s), so the job starts and trains."""
    r = launch(script, 2, tiny_mnist, "--epochs", 1, "--join-timeout", 5, "--timeout", 120,
               "--metrics", tmp_path / "m.jsonl", DDP_TEST_LATE="1:20")
    assert "rank 1 sleeps 20 s before init_process_group" in r.stderr, r.stderr
    assert_trained(tmp_path / "m.jsonl", 1, 2)


@two_gpus
@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_ddp.py"])
def test_a_rank_that_raises_ends_the_nccl_job_in_seconds(script, tiny_mnist, tmp_path):
    """Rank 1 raises in the task's loss_fn on 2 GPUs: its line and the task's frame come first,
    it aborts its NCCL group, and the job ends well before --timeout (300 s): the launcher
    stops rank 0 (SIGTERM, then SIGKILL after 30 s) if nothing tells it sooner."""
    import time

    from test_cluster_safety import RAISES_ON_RANK_1
    repo = conftest.with_task(tmp_path / "repo", RAISES_ON_RANK_1)
    start = time.monotonic()
    r = launch(script, 2, tiny_mnist, "--epochs", 1, "--timeout", 300, repo=repo, check=False)
    took = time.monotonic() - start
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[rank")]
    assert lines and lines[0] == "[rank 1] error: ValueError: a bug in the task", r.stderr
    assert "in loss_fn" in r.stderr and r.returncode != 0, r.stderr
    assert took < 120, (took, r.stderr)


@two_gpus
def test_one_precision_on_gpus_of_two_generations(tiny_mnist, tmp_path):
    """--amp auto with rank 1's GPU made to report compute capability 7.0 (Volta, no bfloat16
    arithmetic): both ranks train in fp32, rank 0 says why once, the checkpoint records it."""
    r = run_script("spawn_ddp.py", "--nproc-per-node", 2, "--data-dir", tiny_mnist,
                   "--batch-size", 64, "--epochs", 1, "--timeout", 60, "--checkpoint",
                   tmp_path / "c.pt", timeout=300, DDP_TEST_GPU_CAPABILITY_OF="1:7.0",
                   DDP_TEST_GPU_RECORD=record_dir(tmp_path))
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("precision: ")]
    assert len(said) == 1 and "the device of rank(s) 1 has no bfloat16" in said[0], r.stdout
    for row in workers(tmp_path / "gpu"):
        assert f"{CONV} float32" in row["outputs"] and f"{CONV} bfloat16" not in row["outputs"]
    assert load_on_cpu(tmp_path / "c.pt")["args"]["amp"] == "none"


# ---- what the third review asked of a GPU (issue 53): each under about a minute -------------

@pytest.mark.parametrize("script", ["spawn_ddp.py", "torchrun_fsdp.py"])
def test_a_stalled_collective_ends_the_job_and_keeps_the_snapshot(script, tiny_mnist, tmp_path):
    """One process on NCCL. Before its 5th optimizer step its GPU sleeps 60 s, so the collective
    that follows (the progress line's all-reduce) cannot complete; with --step-timeout 5,
    PyTorch's watchdog ends the job: a non-zero exit within the step timeout plus 60 s of the
    stall (the figure is printed, to be measured), the timed-out collective named, the snapshot
    of step 4 whole, no process left behind. (On gloo: test_troubleshooting's stalled rank.)"""
    ck = tmp_path / ("c.pt" if script == "spawn_ddp.py" else "snap")
    launcher = (*TORCHRUN, "--nproc-per-node=1") if script != "spawn_ddp.py" else ()
    extra = ("--nproc-per-node", 1) if script == "spawn_ddp.py" else ()
    run = conftest.Watched(
        [sys.executable, *launcher, ROOT / script, *extra, "--data-dir", tiny_mnist,
         "--batch-size", 64, "--log-interval", 5, "--save-every", 4, "--checkpoint", ck,
         "--step-timeout", 5, "--amp", "none"],
        conftest.script_env(gpus=True, DDP_TEST_GPU_STALL="5:60"), timeout=240)
    t_stall, _ = run.first(r"test instrumentation: the GPU sleeps 60 s before step 5")
    print(f"{script}: ended {run.seconds - t_stall:.1f} s after the stall, exit {run.returncode}")
    assert run.returncode != 0 and run.seconds - t_stall < 5 + 60, run.text
    # ProcessGroupNCCL names the collective; torch 2.15's default ProcessGroupNCCL2 does not
    # ("Operation timed out after N ms", "Aborting process on rank N due to timeout")
    assert re.search(r"(?i)all_?reduce|operation timed out|due to timeout", run.text), run.text
    assert re.search(r"(?i)time[ds]? ?out", run.text), run.text
    assert not conftest.session_processes(run.pid)  # nothing of the job is left
    if script == "spawn_ddp.py":
        snapshot = load_on_cpu(ck)
        assert (snapshot["epoch"], snapshot["step"]) == (0, 4)
    else:  # a DCP folder: the progress in run.json, the shards beside DCP's metadata
        from ddpkit import checkpoint
        progress = checkpoint.load(str(ck))
        assert (progress["epoch"], progress["step"]) == (0, 4)
        assert (ck / ".metadata").is_file()


def test_data_workers_on_the_gpu(tiny_mnist, tmp_path):
    """--workers 2 with pinned memory on the GPU: the data comes from worker processes."""
    launch("spawn_ddp.py", 1, tiny_mnist, "--workers", 2, "--metrics", tmp_path / "m.jsonl")
    assert_trained(tmp_path / "m.jsonl", 1, 1)


STOP_CHECK_SYNCS = r"""
import json, warnings, torch, torch.distributed as dist
from ddpkit import sigterm
gpu = torch.device("cuda", 0)
torch.cuda.set_device(gpu)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=gpu)
stop = sigterm.StopSignal("c.pt", gpu, steps=100)
stop.agree = True  # one process: the agreement's all-reduce runs as on many
def syncs(step):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stop(step)
    torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)
print(json.dumps([syncs(1), syncs(2), syncs(3), stop.next]))
stop.close()
dist.destroy_process_group()
"""


def test_the_stop_check_syncs_the_gpu_once_per_check_and_not_between(tmp_path):
    """sigterm.StopSignal on a GPU (torch's sync debug mode counts the host syncs): at most one
    per check (its all-reduce's answer, .tolist()), none between checks."""
    import json
    import subprocess
    r = subprocess.run([sys.executable, "-c", STOP_CHECK_SYNCS], cwd=ROOT, text=True,
                       capture_output=True, timeout=120, env=conftest.script_env(gpus=True))
    assert r.returncode == 0, r.stderr
    first, second, between, next_check = json.loads(r.stdout.splitlines()[-1])
    assert next_check > 3, r.stdout  # steps 1 and 2 were checks, step 3 is not
    assert first <= 1 and second <= 1 and between == 0, r.stdout  # before 53: 2, 2, 0


def test_two_ranks_on_one_gpu_over_gloo(tmp_path):
    """NCCL refuses two ranks on one GPU; gloo takes CUDA tensors (conftest.two_ranks_one_device:
    fp16 autocast, an overflow in one rank, the stop check and reduce_tensor on CUDA tensors),
    and SyncBatchNorm's gloo path makes both ranks' statistics one."""
    rows = conftest.two_ranks_one_device("cuda", tmp_path)
    assert rows[0]["bn"] == "SyncBatchNorm"
    assert torch.allclose(torch.tensor(rows[0]["running_mean"]),
                          torch.tensor(rows[1]["running_mean"]), atol=1e-6)
