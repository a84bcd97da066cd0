"""bench.py runs the real scripts and builds its table from their --metrics output. The
numbers themselves are not checked here (timings on shared machines belong to the benchmark,
not to tests); the table's shape and its consistency are."""
import os
import re

from conftest import run_script


def test_bench_table_on_tiny_data(tiny_mnist):
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--epochs", 2,
                   "--batch-size", 64, "--scripts", "dp_baseline", "spawn_ddp",
                   "--world-sizes", 1, 2, timeout=300)
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
    header, body = rows[0], rows[1:]
    assert "DDP efficiency" in header and "data wait" in header
    cells = {(c[0], c[1]): c for c in ([x.strip() for x in row.strip("|").split("|")] for row in body)}
    cores = len(os.sched_getaffinity(0))
    one, two = f"1 x {cores}", f"2 x {max(1, cores // 2)}"
    assert set(cells) == {("dp_baseline", one), ("spawn_ddp", one), ("spawn_ddp", two)}
    for c in cells.values():
        assert float(c[3].split()[0]) == 100.0  # the tiny data is easy: every run reaches it
        assert re.fullmatch(r"\d+\.\d%", c[6])  # data wait share
    assert float(cells[("spawn_ddp", two)][7]) > 0  # efficiency, 2 processes vs 1
    assert cells[("spawn_ddp", one)][7] == "-"
    assert "at 2 processes / at 1 process" in r.stdout
    assert "Machine:" in r.stdout


def test_bench_refuses_what_it_cannot_run(tiny_mnist):
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--scripts", "dp_baseline",
                   "--world-sizes", 2, check=False)
    assert r.returncode != 0 and "error: no script runs" in r.stderr


def test_bench_compares_channels_last_side_by_side(tiny_mnist):
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--batch-size", 64,
                   "--scripts", "dp_baseline", "--world-sizes", 1, "--channels-last", "both",
                   timeout=300)
    labels = [ln.split("|")[1].strip() for ln in r.stdout.splitlines()
              if ln.startswith("| dp_baseline")]
    assert labels == ["dp_baseline", "dp_baseline +channels_last"]
    assert re.search(r"dp_baseline x1: epoch time with --channels-last / without: \d+\.\d\d",
                     r.stdout)
