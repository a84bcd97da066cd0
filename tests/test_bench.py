"""bench.py runs the real scripts and builds its table from their --metrics output. The
numbers themselves are not checked here (timings on shared machines belong to the benchmark,
not to tests); the table's shape and its consistency are."""
import os
import platform
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
    cores = len(os.sched_getaffinity(0))  # this suite runs on Linux
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


def test_bench_compares_batch_sizes_rules_and_environments(tiny_mnist, tmp_path):
    """The LR-rule table (test accuracy after every epoch, per global batch and rule) and an
    environment variant, side by side in one run, and the chart."""
    chart = tmp_path / "chart.png"
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--epochs", 2,
                   "--batch-size", 64, 128, "--lr-scaling", "sqrt", "linear", "--scripts",
                   "dp_baseline", "--world-sizes", 1, "--with-env", "BENCH_TEST_VARIABLE=1",
                   "--png", chart, timeout=400)
    table = r.stdout.split("Test accuracy after each epoch")[1]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines()
            if ln.startswith("| dp_baseline")]
    assert len(rows) == 8  # 2 batch sizes x 2 rules x with and without the environment
    for row in rows:
        batch, rule, peak = int(row[2]), row[3], float(row[4])
        expected = 0.01 * {"sqrt": (batch / 256) ** 0.5, "linear": batch / 256}[rule]
        assert abs(peak - expected) < 1e-3 * expected, row
        assert len(row) == 8 and all(re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d\)", c) for c in row[5:7])
    assert sum(row[0].endswith("+env") for row in rows) == 4
    assert re.search(r"dp_baseline batch 64 sqrt x1: epoch time with \+env / without: \d+\.\d\d",
                     r.stdout)
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_bench_machine_line_names_the_cpu_features(tiny_mnist):
    r = run_script("bench.py", "--data-dir", tiny_mnist, "--reps", 1, "--batch-size", 64,
                   "--scripts", "dp_baseline", "--world-sizes", 1, timeout=300,
                   DDP_TEST_CPU_FEATURES="avx512_f=1,avx512_bf16=0,amx_bf16=1")
    machine = next(ln for ln in r.stdout.splitlines() if ln.startswith("Machine:"))
    if "x86_64" in platform.machine():
        assert "AVX-512 yes, AVX512_BF16 no, AMX yes" in machine, machine
