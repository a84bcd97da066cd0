"""Clean shutdown: when a DDP script has returned, its process group is really gone.

dist.destroy_process_group() only drops c10d's own references to the group. Anything else that
still holds it keeps gloo's C++ threads running into interpreter shutdown. A thread that needs
the GIL then aborts the process ("terminate called without an active exception", exit code -6),
after the script finished its work. That happens in perhaps one run in a few hundred, so a
test of the exit code alone passes almost always. These tests check the cause instead: no gloo
thread is left in any worker when its script has returned (recorded at atexit by
tests/instrument)."""
import pytest

from conftest import ROOT, read_records, run_script

pytestmark = pytest.mark.slow

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
RUNS = {  # script: (launcher, extra flags, blocked import)
    "spawn_ddp.py": ((), ["--nproc-per-node", 2, "--timeout", 30], None),
    "torchrun_ddp.py": (TORCHRUN, ["--timeout", 30], None),
    "apex_ddp.py": (TORCHRUN, ["--timeout", 30], "apex"),  # the native path
    "lesson/ddp.py": (TORCHRUN, [], None),  # DDP and torchvision imported after its group
}


def gloo_threads(exit_record):
    return [name for name in exit_record["threads"] if "gloo" in name]


def test_the_check_sees_gloo_threads(tmp_path):
    """Control: a group that is never destroyed leaves its gloo threads, and the record shows
    them. Without this, a renamed thread would make the test below pass whatever happens.
    A gloo thread names itself when it first runs, so one collective runs first: without it,
    under load, the snippet could exit before either had run (a busy CI run did). The exit
    code is not checked: the threads left behind may abort the process after the record is
    written ("terminate called without an active exception", 1 run in 40 with a busy core)."""
    code = ("import torch, torch.distributed as dist; "
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1); "
            "dist.all_reduce(torch.ones(1))  # run by a gloo thread: it has named itself")
    (tmp_path / "snippet.py").write_text(code)
    run = run_script(tmp_path / "snippet.py", record=tmp_path, check=False, cwd=tmp_path)
    [record] = read_records(tmp_path, "exit")
    assert gloo_threads(record), (record, run.returncode, run.stderr)


@pytest.mark.parametrize("script", RUNS)
def test_no_gloo_thread_outlives_the_script(tiny_mnist, tmp_path, script):
    launcher, extra, block = RUNS[script]
    run_script(script, "--data-dir", tiny_mnist, "--batch-size", 64, *extra,
               launcher=launcher, block=block, record=tmp_path)
    exits = read_records(tmp_path, "exit")
    assert sorted(e["rank"] for e in exits) == [0, 1]  # both workers got to the end
    for e in exits:
        assert not gloo_threads(e), e


def test_the_troubleshooting_programs_shut_gloo_down_too(tmp_path):
    """tests/troubleshooting/unused_parameters.py starts its own gloo group (docs quote it): it
    imports torch.distributed.nn before the group exists, as common.py does, or its gloo
    threads outlive it and a CI run aborted with "terminate called without an active
    exception"."""
    run_script(ROOT / "tests" / "troubleshooting" / "unused_parameters.py", record=tmp_path,
               timeout=120)
    exits = read_records(tmp_path, "exit")
    assert sorted(e["rank"] for e in exits) == [0, 1]
    for e in exits:
        assert not gloo_threads(e), e
