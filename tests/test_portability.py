"""Learners run these scripts on macOS and Windows laptops. No macOS or Windows machine runs
this suite, so two stand-ins do:

- a static check lists every use of an API that macOS or Windows lacks (Python's docs mark them
  "Availability: Linux" or "Unix") in the scripts, their modules and bench.py, and fails on one
  that is not guarded by hasattr(), a platform test or a try/except;
- the scripts run for real with those APIs removed from `os` and /proc unreadable
  (DDP_TEST_NOT_LINUX in tests/instrument); bench.py too, in
  test_bench_compares_environments_and_another_checkout.
"""
import ast

import pytest

from conftest import ROOT, read_metrics, repo_files, run_script

MODULES = ("common.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ddpkit").glob("*.py")))
FILES = (*MODULES, "spawn_ddp.py", "torchrun_ddp.py", "dp_baseline.py", "apex_ddp.py", "bench.py")
MISSING_OFF_LINUX = {  # absent on macOS and Windows (Python docs: "Availability: Linux")
    "os": {"sched_getaffinity", "sched_setaffinity", "pidfd_open", "memfd_create", "eventfd",
           "posix_fadvise", "O_DIRECT"},
    "signal": {"pidfd_send_signal", "sigwaitinfo", "sigtimedwait", "SIGRTMIN", "SIGRTMAX",
               "SIGPWR", "SIGSTKFLT"},
    "socket": {"SO_BINDTODEVICE", "MSG_NOSIGNAL"},
}
MISSING_ON_WINDOWS = {  # "Availability: Unix"
    "os": {"fork", "forkpty", "killpg", "getpgid", "getpgrp", "setpgid", "setpgrp", "setsid",
           "getsid", "nice", "getuid", "geteuid", "getgid", "uname", "getloadavg", "sysconf",
           "pathconf", "confstr", "wait3", "wait4", "WNOHANG", "statvfs", "register_at_fork",
           "sched_yield"},
    "signal": {"SIGKILL", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCHLD",
               "SIGPIPE", "alarm", "pause", "setitimer", "getitimer", "siginterrupt",
               "pthread_kill", "pthread_sigmask", "sigpending", "sigwait"},
    "socket": {"SO_REUSEPORT"},
}
UNIX_MODULES = {"resource", "fcntl", "pwd", "grp", "termios", "pty"}
LINUX_PATHS = ("/proc/", "/sys/", "/dev/shm")
GUARD_EXCEPTIONS = {"AttributeError", "OSError", "ImportError", "ModuleNotFoundError",
                    "FileNotFoundError", "Exception"}


def platform_uses(source, filename="<source>"):
    """Every unguarded use of a Linux- or Unix-only API: [(line, what)]."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def guarded(node, module, name):
        while node in parents:
            child, node = node, parents[node]
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and child is not node.test:
                test = ast.unparse(node.test)
                if (f'hasattr({module}, "{name}")' in test or f"hasattr({module}, '{name}')" in test
                        or "sys.platform" in test or "os.name" in test or "platform.system" in test):
                    return True
            if isinstance(node, ast.BoolOp) and child is not node.values[0]:  # hasattr(...) and use
                if any(f"hasattr({module}" in ast.unparse(v) for v in node.values[:node.values.index(child)]):
                    return True
            if isinstance(node, ast.Try) and child in node.body:
                for handler in node.handlers:
                    caught = ast.unparse(handler.type) if handler.type else "Exception"
                    if any(e in caught for e in GUARD_EXCEPTIONS):
                        return True
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module, name = node.value.id, node.attr
            for table, where in ((MISSING_OFF_LINUX, "Linux only"), (MISSING_ON_WINDOWS, "not on Windows")):
                if name in table.get(module, ()) and not guarded(node, module, name):
                    found.append((node.lineno, f"{module}.{name} ({where})"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for n in names:
                if n and n.split(".")[0] in UNIX_MODULES and not guarded(node, n, ""):
                    found.append((node.lineno, f"import {n} (not on Windows)"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(LINUX_PATHS) and not guarded(node, "", ""):
                found.append((node.lineno, f"{node.value!r} (Linux only)"))
    return sorted(found)


def test_the_check_finds_unguarded_uses():
    """Control: without this, a check that finds nothing would pass whatever the scripts do."""
    source = '''
import os, signal, fcntl
n = len(os.sched_getaffinity(0))
if hasattr(os, "sched_getaffinity"):
    m = len(os.sched_getaffinity(0))
k = hasattr(os, "killpg") and os.killpg(1, signal.SIGTERM)
signal.signal(signal.SIGUSR1, print)
try:
    open("/proc/cpuinfo")
except OSError:
    pass
open("/proc/meminfo")
'''
    assert [what for _, what in platform_uses(source)] == [
        "import fcntl (not on Windows)", "os.sched_getaffinity (Linux only)",
        "signal.SIGUSR1 (not on Windows)", "'/proc/meminfo' (Linux only)"]


@pytest.mark.parametrize("name", FILES)
def test_no_unguarded_linux_only_call(name):
    uses = platform_uses((ROOT / name).read_text(), name)
    assert not uses, "\n".join(f"{name}:{line}: {what}" for line, what in uses)


NOT_LINUX = {"DDP_TEST_NOT_LINUX": 1}


@pytest.mark.slow
def test_spawn_without_linux_apis(tiny_mnist, tmp_path):
    """Threads per process from os.cpu_count (Python >= 3.13: os.process_cpu_count) instead of
    the Linux affinity mask; everything else as on Linux."""
    r = run_script("spawn_ddp.py", "--data-dir", tiny_mnist, "--nproc-per-node", 2,
                   "--batch-size", 64, "--metrics", tmp_path / "m.jsonl", **NOT_LINUX)
    assert "thread(s) each" in r.stdout
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["world_size"] == 2 and row["train_loss"] < 2.3


@pytest.mark.slow
def test_one_process_without_linux_apis(tiny_mnist, tmp_path):
    """What a laptop user without torchrun runs: `python SCRIPT` (torchrun itself does not
    work on Windows in torch 2.14; README, On a laptop): apex_ddp.py here; dp_baseline.py and
    torchrun_ddp.py in test_one_process_listens_on_nothing_reachable."""
    run_script("apex_ddp.py", "--data-dir", tiny_mnist, "--batch-size", 64, "--metrics",
               tmp_path / "m.jsonl", block="apex", **NOT_LINUX)
    [row] = read_metrics(tmp_path / "m.jsonl")
    assert row["world_size"] == 1 and row["train_loss"] < 2.3


def test_every_python_file_parses_as_python_3_10():
    """The oldest Python the supported torch releases run on (torch 2.4 supports 3.8 to 3.12;
    the scripts ask for 3.10): no syntax of a later Python in any file of the repo."""
    files = repo_files("*.py")
    assert len(files) > 10
    for path in files:
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))
