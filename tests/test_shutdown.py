"""Clean shutdown: when a script has returned, its process group is really gone, or the process
ends without the interpreter's finalization.

dist.destroy_process_group() only drops c10d's own references to the group. Anything else that
still holds it keeps gloo's C++ threads running into interpreter shutdown. A thread that needs
the GIL then aborts the process ("terminate called without an active exception", exit code -6),
after the script finished its work. That happens in perhaps one run in a few dozen, so a test of
the exit code alone passes almost always. These tests check the cause instead, in the records
of tests/instrument: no gloo thread is left in any DDP worker when its script has returned; an
FSDP worker's are (torch keeps FSDP's group in DTensor's caches), and it ends by os._exit
(launch.end) with them, before any finalization."""
import pytest
import torch

from conftest import read_records, run_script

# apex_ddp.py's native path; lesson/ddp.py imports DDP and torchvision after its group starts
RUNS = ["spawn_ddp.py", "torchrun_ddp.py", pytest.param("apex_ddp.py", marks=pytest.mark.slow),
        "lesson/ddp.py", pytest.param("torchrun_fsdp.py", marks=pytest.mark.skipif(
            torch.__version__ < (2, 7), reason="FSDP2 on a CPU needs torch 2.7"))]


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
def test_no_gloo_thread_outlives_the_script_or_meets_the_finalization(preempted, lesson_run,
                                                                      script):
    """The shared runs' (conftest.preempted, resumed; conftest.lesson_run): each process's
    threads when its script has returned, and how it ended. (The programs of
    tests/troubleshooting/ that the docs quote: test_info_names_the_parameters_without_a_gradient;
    lesson/fsdp.py: test_fsdp_chapter_evaluates_evenly_and_ends_every_time.)"""
    rec = lesson_run("ddp") / "rec" if script.startswith("lesson") else preempted(script) / "rec"
    last = {e["rank"]: e for e in read_records(rec, "exit")}  # each process's last record
    assert sorted(last) == [0, 1]  # both workers got to the end
    for e in last.values():
        if script == "torchrun_fsdp.py":
            assert e["then"] == "os._exit" and e["code"] == 0, e
        else:
            assert not gloo_threads(e), e
