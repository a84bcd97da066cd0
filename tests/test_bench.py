"""bench.py runs the real scripts and builds its table from their --metrics output. The
numbers themselves are not checked here (timings on shared machines belong to the benchmark,
not to tests); the table's shape and its consistency are, for every kind of option."""
import json
import os
import platform
import re
import shutil

import pytest

from conftest import ROOT, run_script

pytestmark = pytest.mark.slow


def table_rows(text, start="| script"):
    """The rows of the first table from `start` on, as lists of cells."""
    table = text.split(start, 1)[1].strip("\n").split("\n\n", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


def test_bench_table_on_tiny_data(tiny_mnist):
    """A DDP script at two world sizes, the default beside fp32 in NCHW (the plain table): the
    table, the DDP efficiency column, the ratio lines, and the machine line with the CPU
    features that decide the precision (faked here). (dp_baseline's rows: the tests below.)
    Why 40 s: bench.py launches spawn_ddp.py four times (two world sizes, two settings)."""
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--batch-size", 64,
                   "--scripts", "spawn_ddp", "--world-sizes", 1, 2, timeout=400,
                   DDP_TEST_CPU_FEATURES="avx512_f=1,avx512_bf16=0,amx_bf16=1")
    cells = {(c[0], c[1]): c for c in table_rows(r.stdout)}
    cores = len(os.sched_getaffinity(0))  # this suite runs on Linux
    one, two = f"1 x {cores}", f"2 x {max(1, cores // 2)}"
    assert set(cells) == {(f"spawn_ddp{b}", n) for b in ("", " fp32-nchw") for n in (one, two)}
    for s, n in (("spawn_ddp", 1), ("spawn_ddp", 2)):
        assert re.search(rf"- {s} x{n}: epoch time with fp32-nchw \(--amp none "
                         rf"--no-channels-last\) / without: \d+\.\d\d", r.stdout), (s, n)
    for c in cells.values():
        assert float(c[3].split()[0]) == 100.0  # the tiny data is easy: every run reaches it
        assert re.fullmatch(r"0\.\d{3}", c[6])  # data_wait: a fraction, as --metrics says it
    assert float(cells[("spawn_ddp", two)][7]) > 0  # efficiency, 2 processes vs 1
    assert cells[("spawn_ddp", one)][7] == "-"
    assert "at 2 processes / at 1 process" in r.stdout
    machine = next(ln for ln in r.stdout.splitlines() if ln.startswith("Machine:"))
    if "x86_64" in platform.machine():
        assert "AVX-512 yes, AVX512_BF16 no, AMX yes" in machine, machine


def test_bench_compares_batch_sizes_and_layouts(tiny_mnist, tmp_path):
    """Two options at once, every combination side by side: the LR table (test accuracy after
    every epoch, per global batch), one ratio line per option, and the chart."""
    chart = tmp_path / "chart.png"
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--epochs", 2,
                   "--batch-size", 64, 128, "--scripts", "dp_baseline", "--world-sizes", 1,
                   "--channels-last", "both", "--png", chart, timeout=400)
    labels = [row[0] for row in table_rows(r.stdout)]
    assert len(labels) == 4 and len(set(labels)) == 4  # 2 batch sizes x 2 layouts
    lr_table = table_rows(r.stdout.split("test_acc after each epoch")[1])
    assert len(lr_table) == 4
    for row in lr_table:
        batch, rule, peak = int(row[2]), row[3], float(row[4])
        assert rule == "sqrt" and abs(peak - 0.01 * (batch / 256) ** 0.5) < 1e-5, row
        assert all(re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d\)", c) for c in row[5:7]), row
    for what in (r"with --channels-last / without", r"with batch 128 / with batch 64"):
        assert re.search(rf"dp_baseline .*x1: epoch time {what}: \d+\.\d\d", r.stdout), what
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_bench_compares_workers_and_the_stop_agreement(tiny_mnist):
    """--workers 0 1 and --checkpoint both (the SIGTERM agreement on)."""
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--batch-size", 64,
                   "--scripts", "dp_baseline", "--world-sizes", 1, "--workers", 0, 1,
                   "--checkpoint", "both", timeout=400)
    labels = {row[0] for row in table_rows(r.stdout)}
    assert labels == {f"dp_baseline {w}{c}" for w in ("workers 0", "workers 1")
                      for c in ("", " +checkpoint")}
    for what in ("with --workers 1 / with --workers 0",
                 r"with --checkpoint \(the SIGTERM agreement\) / without"):
        assert re.search(rf"dp_baseline .*x1: epoch time {what}: \d+\.\d\d", r.stdout), what


def test_bench_compares_environments_and_another_checkout(tiny_mnist, tmp_path):
    """--with-env (variables set for a second run of each configuration) and --against a copy
    of the scripts (another commit's, in real use). Without Linux's APIs (DDP_TEST_NOT_LINUX,
    tests/instrument: no affinity mask, no /proc), as on a macOS or Windows laptop
    (test_portability.py): the machine line still names the CPU's bfloat16 features."""
    other = tmp_path / "other"
    other.mkdir()
    for f in ROOT.glob("*.py"):
        shutil.copy(f, other)
    shutil.copytree(ROOT / "ddpkit", other / "ddpkit")
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--batch-size", 64,
                   "--scripts", "dp_baseline", "--world-sizes", 1,
                   "--with-env", "BENCH_TEST_VARIABLE=1", "--against", other, timeout=400,
                   DDP_TEST_NOT_LINUX=1)
    machine = next(ln for ln in r.stdout.splitlines() if ln.startswith("Machine:"))
    assert "BF16" in machine, machine  # the CPU features, read without /proc
    labels = {row[0] for row in table_rows(r.stdout)}
    assert labels == {f"dp_baseline{e}{a}" for e in ("", " +env") for a in ("", f" @{other}")}
    for what in (r"with \+env / without", rf"with @{re.escape(str(other))} / with the scripts here"):
        assert re.search(rf"dp_baseline .*x1: epoch time {what}: \d+\.\d\d", r.stdout), what


def test_bench_draws_the_curves_of_a_stopped_and_resumed_run(preempted, tmp_path):
    """bench.py --curves (docs/training.md's picture): the folder of spawn_ddp.py's shared run,
    stopped by SIGTERM and resumed, drawn as a PNG, the resumed run marked at the step after
    its snapshot."""
    import bench
    d = preempted("spawn_ddp.py")
    snap = json.loads((d / "snapshot.json").read_text())
    assert bench.save_curves(d / "tb", tmp_path / "c.png") == [snap["step"] + 1]
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
