"""Shared test helpers: tiny MNIST IDX files, running the real scripts as subprocesses."""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
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


@pytest.fixture(scope="session")
def straight(tiny_mnist, tmp_path_factory):
    """Runs that nothing interrupts, trained once per session and shared by every test that
    compares with one: straight(nproc, batch, epochs) is the folder of its final checkpoint
    `c.pt`, its metrics `m.jsonl` and its records `rec/` (tests/instrument). One process:
    dp_baseline.py with every core; more: torchrun_ddp.py with one thread per process, which
    trains exactly what spawn_ddp.py, apex_ddp.py's native O0 path, two nodes of one process
    and two SLURM nodes train at that world size (tests compare them bit for bit). Under
    pytest-xdist (`-n 2`) the test processes share them too: the first to ask trains, under a
    lock, in the folder the workers' temporary folders have in common."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "straight"
    shared.mkdir(exist_ok=True)

    def get(nproc, batch, epochs):
        d = shared / f"{nproc}x-batch{batch}-epochs{epochs}"
        with FileLock(f"{d}.lock"):
            if not (d / "done").exists():
                shutil.rmtree(d, ignore_errors=True)  # a run that failed half-way
                (d / "rec").mkdir(parents=True)
                args = ("--data-dir", tiny_mnist, "--batch-size", batch, "--epochs", epochs,
                        "--log-interval", 5, "--checkpoint", d / "c.pt",
                        "--metrics", d / "m.jsonl")
                if nproc == 1:
                    run_script("dp_baseline.py", *args, record=d / "rec",
                               **threads("dp_baseline.py"))
                else:
                    run_script("torchrun_ddp.py", *args, record=d / "rec",
                               **threads("torchrun_ddp.py"),
                               launcher=("-m", "torch.distributed.run", "--standalone",
                                         f"--nproc-per-node={nproc}"))
                (d / "done").touch()
        return d
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


def run_script(script, *args, timeout=120, record=None, block=None, check=True, launcher=(),
               cwd=ROOT, allow=None, pythonpath=(), gpus=False, repo=ROOT, **extra_env):
    """Run a script of the repo (or of a copy of it, `repo`: with_task) under `launcher` (e.g.
    torchrun's module) as its own process group; kill the group on timeout."""
    cmd = [sys.executable, *map(str, launcher), str(Path(repo) / script), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=script_env(record, block, pythonpath, gpus,
                                                         **extra_env),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
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


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


class Watched:
    """A command's merged stdout and stderr, each line with the seconds since it started."""

    def __init__(self, cmd, env, timeout, on_line=None, cwd=ROOT):
        self.lines, start = [], time.monotonic()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.pid = proc.pid
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
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
                os.killpg(proc.pid, signal.SIGKILL)
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def sigterm_when(cmd, line_start, env, cwd=ROOT, timeout=180):
    """Runs `cmd` as a process group of its own and, once a line of its output starts with
    `line_start`, sends SIGTERM to the whole group (data workers included, as torchrun's
    os.killpg and SLURM's scancel do); returns (the rest of stdout, stderr) when it has ended."""
    with process_group(cmd, env, cwd) as proc:
        for line in proc.stdout:
            if line.startswith(line_start):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=timeout)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def run_mains(script, cases, timeout=240, **extra_env):
    """Each case ({"argv": [...], "env": {...}}) through `script`'s real main() in one process
    (tests/run_mains.py): a list of results with "code", "stdout", "stderr", "started"."""
    lines = "".join(json.dumps(case) + "\n" for case in cases)
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "run_mains.py"), str(ROOT / script)],
                       input=lines, capture_output=True, text=True, cwd=ROOT,
                       env=script_env(**extra_env), timeout=timeout)
    assert p.returncode == 0, p.stderr
    results = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(results) == len(cases), p.stdout
    return results


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
