"""Shared test helpers: tiny MNIST IDX files, running the real scripts as subprocesses."""
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from filelock import FileLock  # installed with torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests import common.py
INSTRUMENT = Path(__file__).resolve().parent / "instrument"
N_TRAIN, N_TEST = 600, 101  # 101 divides by neither 2 nor 3
NO_BF16 = "avx512_bf16=0,amx_bf16=0,bf16=0,sve_bf16=0"  # a CPU without bfloat16 instructions


def write_idx(path, tensor):
    """An uncompressed IDX file as MNIST ships it (magic 0x08 = unsigned byte, then dims)."""
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 0x08, tensor.dim()))
        f.write(struct.pack(f">{tensor.dim()}I", *tensor.shape))
        f.write(tensor.to(torch.uint8).numpy().tobytes())


def make_tiny_mnist(root, n_train=N_TRAIN, n_test=N_TEST, seed=0):
    """Learnable fake digits (a fixed template per class plus noise) in MNIST's file format,
    so the data goes through torchvision's real MNIST reader."""
    g = torch.Generator().manual_seed(seed)
    templates = (torch.rand(10, 28, 28, generator=g) > 0.7).float() * 200
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = torch.randint(0, 10, (n,), generator=g)
        x = (templates[y] + torch.randn(n, 28, 28, generator=g) * 70).clamp(0, 255)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", x)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)
    return Path(root)


def pytest_collection_modifyitems(items):
    """The SLURM and elastic groups are slow too: `-m "not slow"` leaves them out."""
    for item in items:
        if item.get_closest_marker("slurm") or item.get_closest_marker("elastic"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    return make_tiny_mnist(tmp_path_factory.mktemp("mnist"))


def threads(script):
    """The threads a script under test gets when it must train exactly what a `straight` run
    trains: one per process in the DDP scripts on any machine (spawn_ddp.py would take cores /
    processes: another rounding on a bigger machine); dp_baseline.py takes every core, as in
    its straight run."""
    return {} if Path(script).name == "dp_baseline.py" else {"OMP_NUM_THREADS": 1}


# ---- Runs shared by the whole session: one run, many assertions (docs/maintainers.md) -------

TRAIN = ("--batch-size", 32, "--epochs", 2)  # 19 steps an epoch on the tiny MNIST (600 images)
TORCHRUN2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """once(name, make): make(folder) runs once in the session, in whichever test process asks
    first, under a file lock; every other test, in any process, gets the folder it filled.
    Under pytest-xdist the folder is in the one the workers' temporary folders share. A make
    that fails is not run again: it and every test that asks after it fail with its error and
    the end of each launch's stderr (`keep`), where the cause is (a traceback in the script)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)

    def once(name, make):
        d, failed = root / name, root / f"{name}.failed"
        with FileLock(f"{d}.lock"):
            if not failed.exists() and not (d / "done").exists():
                shutil.rmtree(d, ignore_errors=True)
                (d / "rec").mkdir(parents=True)
                try:
                    make(d)
                    (d / "done").touch()
                except (Exception, pytest.fail.Exception) as e:
                    said = "".join(f"\n--- its launch {f.stem} exited {k.returncode}; stderr ends:\n"
                                   + "\n".join(k.stderr.splitlines()[-25:])
                                   for f in sorted(d.glob("*.launch")) for k in [kept(d, f.stem)])
                    failed.write_text(f"the shared run {name} failed: {type(e).__name__}: "
                                      f"{str(e)[-3000:]}{said}")
        if failed.exists():
            pytest.fail(failed.read_text(), pytrace=False)
        return d
    return once


def keep(d, name, result):
    """A finished launch's exit code and output, as a shared run's file."""
    (d / f"{name}.launch").write_text(json.dumps(
        {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}))


def kept(d, name):
    return subprocess.CompletedProcess([], **json.loads((d / f"{name}.launch").read_text()))


@pytest.fixture(scope="session")
def straight(tiny_mnist, shared):
    """straight(nproc, epochs=2, accumulate=1), at global batch 32: a run nothing interrupts, a
    folder with `c.pt`, `m.jsonl`, `rec/` (tests/instrument) and its output (`kept(d, "run")`).
    One process: dp_baseline.py with every core; more: torchrun_ddp.py, one thread a process,
    which trains exactly what spawn_ddp.py, apex_ddp.py's native path in fp32, torchrun_fsdp.py
    in fp32, and nodes of one process train at that world size (tests compare them bit for bit)."""
    def get(nproc, epochs=2, accumulate=1):
        script = "dp_baseline.py" if nproc == 1 else "torchrun_ddp.py"

        def make(d):
            keep(d, "run", run_script(  # torchrun's one thread a process, unasked
                script, "--data-dir", tiny_mnist, *TRAIN[:2], "--epochs", epochs, "--accumulate",
                accumulate, "--log-interval", 5, "--checkpoint", d / "c.pt", "--metrics",
                d / "m.jsonl", record=d / "rec", nproc=nproc))
        return shared(f"straight-{nproc}x-epochs{epochs}-accumulate{accumulate}", make)
    return get


# script: (its own flags, the straight run it ends as: conftest.straight's (nproc, accumulate))
PREEMPTED = {
    "spawn_ddp.py": (("--workers", 2, "--accumulate", 2, "--deterministic"), (2, 2)),
    "torchrun_ddp.py": (("--workers", 2, "--accumulate", 2, "--deterministic"), (2, 2)),
    "torchrun_fsdp.py": (("--workers", 2, "--accumulate", 2), (2, 2)),
    "apex_ddp.py": ((), (2, 1)),  # its native path, O1: fp32 on these CPUs
    "dp_baseline.py": (("--workers", 2), (1, 1)),
}
UNDER_TORCHRUN = ("torchrun_ddp.py", "torchrun_fsdp.py", "apex_ddp.py")
STEP_DELAY = 0.1  # seconds: the least a step of the stopped run takes (DDP_TEST_STEP_DELAY)
# spawn_ddp.py's first run: rank 0's CPU computes bfloat16, rank 1's does not (tests/instrument),
# and the modules' output dtypes are recorded: --amp auto picks fp32 for the whole job
# (test_cluster_safety.py's test_one_precision_for_the_whole_job)
STOPPED_ENV = {"spawn_ddp.py": {"DDP_TEST_CPU_FEATURES": "avx512_bf16=1,amx_bf16=1",
                                "DDP_TEST_CPU_FEATURES_OF": f"1:{NO_BF16}"}}


@pytest.fixture(scope="session")
def preempted(tiny_mnist, shared):
    """preempted(script): its run stopped by SIGTERM to every process of the job, data workers
    too (as SLURM and torchrun send it), once rank 0 logged step 5 of epoch 1, and the same
    command again (with --resume where the script does not resume by itself); in both, every
    process keeps an idle thread-pool worker, as a task's data reader leaves one
    (DDP_TEST_THREAD_POOL), and must end by itself all the same. A folder with:
    their outputs (`kept(d, "stopped")`, `kept(d, "resumed")`), the snapshot's position and the
    files beside it then (`snapshot.json`), the final checkpoint (`c.pt`, or `snap` and its
    `converted.pt`), the resumed run's metrics (`m.jsonl`), both runs' curves (`tb/`,
    --tensorboard), the records (tests/instrument:
    `rec1/` with DDP_TEST_GPU_RECORD, `rec/` with DDP_TEST_ALLREDUCE_LOG)."""
    def get(script):
        extra, (nproc, _) = PREEMPTED[script]
        torchrun = script in UNDER_TORCHRUN

        def make(d):
            ckpt = d / ("snap" if script == "torchrun_fsdp.py" else "c.pt")
            group = () if script == "dp_baseline.py" else ("--timeout", 77)
            cmd = command(script, nproc, "--data-dir", tiny_mnist, *TRAIN, "--log-interval", 1,
                          *group, *extra, "--checkpoint", ckpt, "--metrics", d / "m.jsonl",
                          "--tensorboard", d / "tb")
            (d / "rec1").mkdir()
            threads_of = {} if torchrun else threads(script)  # torchrun's: 1, unasked
            env = script_env(record=d / "rec1", block="apex", DDP_TEST_STEP_DELAY=STEP_DELAY,
                             DDP_TEST_GPU_RECORD=d / "rec1", DDP_TEST_THREAD_POOL=1,
                             **threads_of, **STOPPED_ENV.get(script, {}))
            keep(d, "stopped", sigterm_when(cmd, "epoch 1/2 step 5/", env))
            position = json.loads((ckpt / "run.json").read_text()) if ckpt.is_dir() else \
                torch.load(ckpt, weights_only=True)
            (d / "snapshot.json").write_text(json.dumps(
                {"epoch": position["epoch"], "step": position["step"], "left": sorted(
                    p.name for p in d.iterdir() if p.name.startswith(ckpt.name))}))
            resume = [] if torchrun else ["--resume"]  # torchrun's scripts resume by themselves
            keep(d, "resumed", together([cmd + resume], timeout=240, record=d / "rec", block="apex",
                                        DDP_TEST_ALLREDUCE_LOG=d / "rec", DDP_TEST_THREAD_POOL=1,
                                        **threads_of)[0])
            if ckpt.is_dir():  # as torch's converter makes it one file, once
                torch.save(load(ckpt), d / "converted.pt")
        return shared(f"preempted-{script}", make)
    return get


def final(d):
    """The checkpoint a shared run ended with, as a file's: `converted.pt` for a DCP folder."""
    return torch.load(d / "converted.pt", weights_only=True) if (d / "converted.pt").exists() \
        else load(d / "c.pt")


@pytest.fixture(scope="session")
def first_epoch(tiny_mnist, shared):
    """Epoch 1 of 2 at 2 processes (spawn_ddp.py, TRAIN's flags, one thread each), stopped
    there (--stop-after 1): the checkpoint `c.pt` that tests continue, copy or refuse to
    continue (copy it to write to it)."""
    def make(d):
        run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 2, *TRAIN,
                   "--stop-after", 1, "--checkpoint", d / "c.pt", OMP_NUM_THREADS=1)
    return shared("first-epoch", make) / "c.pt"


# tasks/NAME.py: its flags (8 steps an epoch at 2 processes), and those of every run of it
TASKS = {"text": ("--samples", 512, "--batch-size", 64),
         "regression": ("--samples", 1024, "--batch-size", 128),
         "cifar10": ("--dummy", "--batch-size", 64)}  # 512 images of torchvision's FakeData
TASK_RUN = ("--workers", 2, "--epochs", 2, "--log-interval", 1)


def given(d, name):
    """How conftest.task_run gives the task: (its --task, the PYTHONPATH it needs). The text
    task as a module of a package outside the checkout (--task mypkg.text), the regression as
    a file there."""
    if name == "text":
        return "mypkg.text", [d / "lib"]
    return d / "task" / f"{name}.py", []


@pytest.fixture(scope="session")
def task_run(shared):
    """task_run(name): tasks/NAME.py copied outside the checkout (`given`) and trained by
    spawn_ddp.py from there, 2 processes of one thread, TASK_RUN's flags, nothing interrupting
    it: a folder with `c.pt`, `m.jsonl` and the output (`kept(d, "run")`), for
    test_other_tasks.py and test_fsdp.py."""
    def get(name):
        def make(d):
            task, path = given(d, name)
            copy = d / "lib" / "mypkg" / "text.py" if path else Path(task)
            copy.parent.mkdir(parents=True)
            if path:
                (copy.parent / "__init__.py").write_text("")
            shutil.copy(ROOT / "tasks" / f"{name}.py", copy)
            keep(d, "run", run_script(
                "spawn_ddp.py", "--task", task, *TASKS[name], *TASK_RUN, "--nproc-per-node", 2,
                "--checkpoint", d / "c.pt", "--metrics", d / "m.jsonl", cwd=d, timeout=300,
                pythonpath=path, OMP_NUM_THREADS=1))
        return shared(f"task-{name}", make)
    return get


@pytest.fixture(scope="session")
def lesson_run(tiny_mnist, shared):
    """The README's lesson pair, trained once for test_lesson.py and test_smoke.py:
    lesson_run("one_process") or lesson_run("ddp") (2 processes under torchrun), 2 epochs at
    global batch 32: a folder with its checkpoint `c.pt`, its records `rec/` and its output
    (`kept(d, "run")`)."""
    def get(name):
        def make(d):
            keep(d, "run", run_script(
                f"lesson/{name}.py", "--data-dir", tiny_mnist, *TRAIN, "--checkpoint", d / "c.pt",
                launcher=TORCHRUN2 if name == "ddp" else (), record=d / "rec", timeout=180,
                OMP_NUM_THREADS=1))
        return shared(f"lesson-{name}", make)
    return get


def script_env(record=None, block=None, pythonpath=(), gpus=False, **extra):
    """The environment of a script under test: tests/instrument on the path, no instrumentation
    unless asked for, every warning shown. The GPUs are hidden unless `gpus`: the CPU tests
    run on gloo whatever the machine has (tests marked `cuda` ask for them). The scripts
    believe their CPU has no bfloat16 instructions, so that `--amp auto` (the default) is fp32
    on every machine: the tests compare fp32 runs, and their results do not depend on the CPU
    that runs them. A test of the precision itself sets DDP_TEST_CPU_FEATURES ("" for the real
    CPU)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_TEST_")}
    env["DDP_TEST_CPU_FEATURES"] = NO_BF16
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, pythonpath), str(INSTRUMENT),
                                                      env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "default::DeprecationWarning,default::FutureWarning"  # show all
    env.pop("OMP_NUM_THREADS", None)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update({k: str(v) for k, v in extra.items()})
    if record:
        env["DDP_TEST_RECORD"] = str(record)
    if block:
        env["DDP_TEST_BLOCK"] = block
    return env


def command(script, nproc, *args, repo=ROOT):
    """The command line that starts `script` (of `repo`) with `nproc` processes, and `args`:
    spawn_ddp.py spawns them itself; the others run under torchrun --standalone, or, one,
    as a plain process (dp_baseline.py always is)."""
    if script == "spawn_ddp.py":
        args = ("--nproc-per-node", nproc, *args)
    launcher = (*TORCHRUN2[:-1], f"--nproc-per-node={nproc}") if nproc > 1 and script not in (
        "spawn_ddp.py", "dp_baseline.py") else ()
    return [sys.executable, *launcher, str(Path(repo) / script), *map(str, args)]


def run_script(script, *args, timeout=120, record=None, block=None, check=True, launcher=(),
               cwd=ROOT, allow=None, pythonpath=(), gpus=False, repo=ROOT, nproc=None,
               **extra_env):
    """Run a script of the repo (or of a copy of it, `repo`: with_task) under `launcher` (e.g.
    torchrun's module), or with `nproc` processes as `command` starts them, as its own process
    group; kill the group on timeout."""
    cmd = command(script, nproc, *args, repo=repo) if nproc else \
        [sys.executable, *map(str, launcher), str(Path(repo) / script), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=script_env(record, block, pythonpath, gpus,
                                                         **extra_env),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(map(str, args))} hung for {timeout}s\n{out}\n{err}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    assert_no_deprecation_warnings(out + err, allow)
    return result


def with_task(folder, code):
    """A copy of the repo's scripts in `folder` with `code` appended to its common.py: a task
    of one's own, set up the way docs/your-own-task.md says."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in [*ROOT.glob("*.py"), *ROOT.glob("ddpkit/*.py")]:
        (folder / f.relative_to(ROOT)).parent.mkdir(exist_ok=True)
        (folder / f.relative_to(ROOT)).write_text(f.read_text())
    with open(folder / "common.py", "a") as f:
        f.write("\n\n" + code)
    return folder


def assert_no_deprecation_warnings(text, allow=None):
    """No FutureWarning or DeprecationWarning, except a line containing `allow` (a warning the
    test expects from a launcher it runs on purpose)."""
    for line in text.splitlines():
        if allow and allow in line:
            continue
        assert "FutureWarning" not in line and "DeprecationWarning" not in line, line


def our_frames(text):
    """The traceback frames in `text` of the repository's own files (not of a .venv in it)."""
    return re.findall(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)[^"]*"', text)


def repo_files(pattern):
    """The repository's files that match `pattern`, without .git and a .venv in the checkout
    (the README makes one there)."""
    return sorted(p for p in ROOT.rglob(pattern)
                  if not {".git", ".venv"} & set(p.relative_to(ROOT).parts))


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_tensorboard(folder):
    """{tag: [(step, value), ...]} as TensorBoard's own reader keeps a folder or an event file
    (bench.read_curves, which bench.py draws from)."""
    import bench
    return bench.read_curves(folder)


class Watched:
    """A command's merged stdout and stderr, each line with the seconds since it started."""

    def __init__(self, cmd, env, timeout, on_line=None, cwd=ROOT):
        self.lines, start = [], time.monotonic()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.pid = proc.pid
        killer = threading.Timer(timeout, lambda: kill_all(proc.pid))
        killer.start()
        try:
            for line in proc.stdout:
                self.lines.append((time.monotonic() - start, line.rstrip("\n")))
                if on_line:
                    on_line(self, line)
            self.returncode = proc.wait()
        finally:
            killer.cancel()
            if proc.poll() is None:
                kill_all(proc.pid)
                proc.wait()
        self.seconds = time.monotonic() - start
        self.text = "\n".join(line for _, line in self.lines)
        assert self.returncode != -signal.SIGKILL, f"killed after {timeout} s:\n{self.text}"

    def first(self, pattern):
        """(seconds, line) of the first line that matches `pattern`; fails if none does."""
        for t, line in self.lines:
            if re.search(pattern, line):
                return t, line
        pytest.fail(f"no line matches {pattern!r}:\n{self.text}")


def two_ranks_one_device(device, tmp_path):
    """tests/two_ranks_one_device.py on `device` ("cpu" or "cuda"): what each rank saw, checked
    for what holds on both devices. An infinite gradient in rank 1 alone skips step 2 in both
    (one loss scale, halved there; one model), a SIGTERM seen by rank 1 alone stops both, and
    reduce_tensor averages the ranks."""
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "two_ranks_one_device.py"), device,
                        str(tmp_path)], env=script_env(gpus=device != "cpu", OMP_NUM_THREADS=1,
                                                  DDP_TEST_INF_GRAD_STEP=2,
                                                  DDP_TEST_INF_GRAD_RANK=1),
                       text=True, capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    first = rows[0]["scales"][0]
    assert [row["scales"] for row in rows] == [[first, first / 2, first / 2]] * 2, rows
    assert rows[0]["weights"] == rows[1]["weights"]
    assert [row["stopped"] for row in rows] == [True, True]
    assert [row["mean"] for row in rows] == [0.5, 0.5]
    assert "warning" not in r.stderr.lower(), r.stderr
    return rows


def session_processes(sid, wait=10):
    """Live processes left in a session (zombies awaiting their reaper do not count)."""
    deadline = time.monotonic() + wait
    while True:
        ps = subprocess.run(["ps", "-o", "stat=,args=", "-s", str(sid)], capture_output=True,
                            text=True).stdout.splitlines()
        alive = [p for p in ps if not p.strip().startswith("Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def read_records(directory, name):
    rows = []
    for f in sorted(Path(directory).glob(f"{name}-*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def agreements(records):
    """How many times each rank ran the SIGTERM stop agreement (sigterm.StopSignal): its
    all-reduces of 2 numbers (the stop flag and the pace) in float32, in `records`
    (tests/instrument); the evaluation's sums are float64."""
    checks = {}
    for r in read_records(records, "all_reduce"):
        if r["shape"] == [2] and r["dtype"] == "float32":
            checks[r["rank"]] = checks.get(r["rank"], 0) + 1
    return checks


def max_rel_diff(a, b):
    """The largest difference between two state dicts' float tensors, relative to the largest
    value of the tensor in `b`."""
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp(min=1e-12)).item()
               for k in a if a[k].is_floating_point())


def busy_port():
    """A listening socket on a port of this machine; the caller closes it."""
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    return s


def free_port():
    """A port number that was free a moment ago (for a process about to bind it)."""
    with busy_port() as s:
        return s.getsockname()[1]


def load(path):
    """A checkpoint file; or torchrun_fsdp.py's folder, as torch's converter makes it a file
    (dcp_to_torch), with its run.json, and the optimizer's state numbered by parameter as a
    plain optimizer's is, where DCP names it: the file form's checkpoint."""
    if not Path(path).is_dir():
        return torch.load(path, weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils",
                        "dcp_to_torch", str(path), f"{tmp}/plain.pt"], check=True,
                       capture_output=True)
        ckpt = torch.load(f"{tmp}/plain.pt", weights_only=True)
    names = [name for group in ckpt["optimizer"]["param_groups"] for name in group["params"]]
    ckpt["optimizer"]["state"] = {names.index(k): v for k, v in
                                  ckpt["optimizer"]["state"].items()}
    return {**json.loads((Path(path) / "run.json").read_text()), **ckpt}


def correct_of(state, data, layout=torch.channels_last):
    """How many of the test samples in `data` (tiny MNIST's folder) a model state gets right,
    computed here in one process, in the memory layout the scripts train MNIST in (or another)."""
    import common
    model = common.Net().eval().to(memory_format=layout)
    model.load_state_dict(state)
    test_set = common.make_datasets(types.SimpleNamespace(dummy=False, data_dir=str(data)))[1]
    with torch.no_grad():
        output = model(test_set.images.to(memory_format=layout))
    return int((output.argmax(1) == test_set.labels).sum())


def assert_same_training_state(a, b):
    """Two checkpoints hold exactly the same model, optimizer, scheduler and position."""
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, state in a["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
    assert a["scheduler"] == b["scheduler"]


def workers_of(agent_pid):
    """{rank: pid} of the training processes that torchrun's agent started (its children)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in
                       (d / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(d.name)
    return found


def family(pid):
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


@contextlib.contextmanager
def process_group(cmd, env, cwd=ROOT):
    """`cmd` started as a process group of its own, its output piped; killed, whole, if it still
    runs when the block ends (a failed assertion, a timeout)."""
    proc = subprocess.Popen(cmd, cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_all(proc.pid)
            proc.communicate()


def together(cmds, cwd=lambda n: ROOT, env=lambda n: {}, timeout=180, **common_env):
    """The commands started at once, command n in cwd(n) with script_env(**common_env, **env(n)),
    each as a process group of its own (as nodes of a job, or pods): each CompletedProcess
    once all ended (the groups killed after `timeout`)."""
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=cwd(n), text=True,
                              env=script_env(**{**common_env, **env(n)}), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
             for n, cmd in enumerate(cmds)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outs.append(ended(p, max(0.0, deadline - time.monotonic())))
    finally:
        [kill_all(p.pid) for p in procs if p.poll() is None]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]


def ended(proc, timeout):
    """(stdout, stderr) of `proc` (a process group of its own) once it has ended, or, killed
    with its group after `timeout` s, what it wrote until then: a run that never ends shows
    how far it got (its returncode is then -9)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc.pid)
        out, err = proc.communicate()
        return out, f"{err}\n(test: killed, still running after {timeout:.0f} s)"


def kill_all(pid):
    """SIGKILL to `pid`'s process group and to every process under it: torchrun's workers are
    in sessions of their own, and would outlive their agent (holding the pipes a test reads)."""
    pids = family(pid)  # before: an orphan is no longer found under the agent
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def spawn_nodes(flags, nodes=2, **kw):
    """spawn_ddp.py as `nodes` nodes of this machine meeting at a free port of 127.0.0.1, node n
    with flags(n) (its --nproc-per-node among them): `together`."""
    port = free_port()
    return together([[sys.executable, ROOT / "spawn_ddp.py", "--nnodes", nodes, "--node-rank", n,
                      "--master-addr", "127.0.0.1", "--master-port", port, *flags(n)]
                     for n in range(nodes)], **kw)


def sigterm_when(cmd, line_start, env, cwd=ROOT, timeout=180, alone=False):
    """Runs `cmd` as a process group of its own and, once a line of its output starts with
    `line_start`, sends SIGTERM to the whole group (data workers included, as torchrun's
    os.killpg and SLURM's scancel do), or to the launcher `alone` (as `kill PID` does);
    returns the CompletedProcess once it has ended."""
    with process_group(cmd, env, cwd) as proc:
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith(line_start):
                break
        os.kill(proc.pid, signal.SIGTERM) if alone else os.killpg(proc.pid, signal.SIGTERM)
        rest, err = ended(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out) + rest, err)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


MAINS = {}  # (script, its environment): a tests/run_mains.py of this test process, still running


def run_mains(script, cases, timeout=240, **extra_env):
    """Each case ({"argv": [...], "env": {...}}) through `script`'s real main() in a process of
    its own (tests/run_mains.py): a list of results with "code", "stdout", "stderr", "started".
    One such process per script and environment serves every test of this test process, case
    after case (its start-up, torch's import, once)."""
    key = (script, json.dumps({k: str(v) for k, v in extra_env.items()}, sort_keys=True))
    if key not in MAINS or MAINS[key].poll() is not None:
        log = tempfile.TemporaryFile("w+")
        MAINS[key] = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "run_mains.py"), str(ROOT / script)], cwd=ROOT,
            env=script_env(**extra_env), text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log)
        MAINS[key].log = log
    proc, results = MAINS[key], []
    for case in cases:
        proc.stdin.write(json.dumps(case) + "\n")
        proc.stdin.flush()
        ready = select.select([proc.stdout], [], [], timeout)[0]
        line = proc.stdout.readline() if ready else ""
        if not line:
            MAINS.pop(key).kill()  # the next call starts another
            proc.log.seek(0)
            pytest.fail(f"tests/run_mains.py {script} gave no result for {case} within "
                        f"{timeout} s:\n{proc.log.read()}")
        results.append(json.loads(line))
    return results


@pytest.fixture(scope="session", autouse=True)
def _end_mains():
    yield
    for proc in MAINS.values():  # each case ended: nothing of theirs to finish
        proc.kill()
        proc.wait()


# ---- GPU tests (test_cuda.py, test_real_apex.py): read what GPU runs wrote, on the CPU ---------

def load_on_cpu(path):
    """A checkpoint (or recorded state) written on any device, read here on the CPU: the test
    process itself never allocates GPU memory."""
    return torch.load(path, map_location="cpu", weights_only=True)


def storage_locations(path):
    """The devices a file's tensors were saved from: {"cpu"}, {"cuda:0", "cpu"}, ..."""
    seen = set()

    def keep(storage, location):
        seen.add(location)
        return storage
    torch.load(path, map_location=keep, weights_only=True)
    return seen


def optimizer_steps(ckpt):
    """The steps the checkpoint's optimizer (Adam) really took, one count for all parameters: a
    step that the GradScaler or apex amp skipped after an overflow does not count."""
    steps = {int(s["step"]) for s in ckpt["optimizer"]["state"].values()}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 1.5 MB: room for one checkpoint of this model (about 1 MB) but not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
