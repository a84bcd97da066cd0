"""Run the launch styles side by side on the same work and print one markdown table.

Every configuration runs through its real command line with the same seed, global batch and
epochs, and reports through --metrics. Repetitions are interleaved (rep 1 of every
configuration, then rep 2, ...) with seeds 0, 1, 2, ..., so slow spells of a shared machine
hit all configurations alike; every ratio comes from this one run.

    python bench.py --data-dir ../shared/data                       # the README's table
    python bench.py --data-dir ../shared/data --amp bf16 --reps 5
    python bench.py --data-dir ../shared/data --channels-last both    # NCHW and NHWC side by side
    python bench.py --dummy --reps 1 --scripts spawn_ddp --world-sizes 1 2
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
SCRIPTS = ("dp_baseline", "spawn_ddp", "torchrun_ddp", "apex_ddp")
TARGET = 99.0  # test accuracy, percent
CL = " +channels_last"  # the row label of a run with --channels-last


def command(script, world_size, args):
    """The real command line of one launch style at one world size (None: not applicable)."""
    if script == "dp_baseline":
        return [sys.executable, "dp_baseline.py", "--amp", args.amp] if world_size == 1 else None
    if script == "spawn_ddp":
        return [sys.executable, "spawn_ddp.py", "--nproc-per-node", str(world_size),
                "--amp", args.amp]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={world_size}"]
    if script == "torchrun_ddp":
        return [*torchrun, "torchrun_ddp.py", "--amp", args.amp]
    # apex_ddp.py picks precision by --opt-level: O0 is fp32; O1 is fp16 on GPUs, bf16 on CPU
    native_o1 = "fp16" if torch.cuda.is_available() else "bf16"
    if args.amp not in ("none", native_o1):
        return None
    return [*torchrun, "apex_ddp.py", "--opt-level", "O0" if args.amp == "none" else "O1"]


def run_once(cmd, threads, args, seed):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        data = ["--dummy"] if args.dummy else ["--data-dir", args.data_dir]
        full = [*cmd, *data, "--seed", str(seed), "--epochs", str(args.epochs),
                "--batch-size", str(args.batch_size), "--log-interval", str(10 ** 9),
                "--metrics", str(metrics)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # the same for every launcher
        start = time.perf_counter()
        p = subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.timeout)
        wall = time.perf_counter() - start
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
            sys.exit(f"error: {' '.join(full)} exited with {p.returncode}:\n{tail}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    elapsed, to_target = 0.0, None
    for r in rows:
        elapsed += r["epoch_seconds"]
        if to_target is None and r["test_acc"] >= TARGET:
            to_target = elapsed
    return {"to_target": to_target, "acc": rows[-1]["test_acc"], "wall": wall,
            "epoch_s": statistics.mean(r["epoch_seconds"] for r in rows),
            "samples_s": statistics.mean(r["samples_per_s"] for r in rows),
            "data_wait": statistics.mean(r["data_wait"] for r in rows)}


def spread(values, fmt="{:.1f}"):
    """median (min-max) of the values that exist."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {gpu}; torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("MNIST_DIR", "./data"),
                   help="MNIST root (default: $MNIST_DIR or ./data)")
    p.add_argument("--dummy", action="store_true", help="synthetic data (speed only)")
    p.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    p.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    p.add_argument("--channels-last", choices=["off", "on", "both"], default="off",
                   help="run with --channels-last: off, on, or both side by side (default: off)")
    p.add_argument("--reps", type=int, default=5, help="repetitions, seeds 0..reps-1 (default: 5)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256, help="global batch (default: 256)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default: 900)")
    p.add_argument("--png", metavar="PATH", help="also save a chart (needs matplotlib)")
    args = p.parse_args()
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("error: --png needs matplotlib: pip install matplotlib")

    variants = {"off": [""], "on": [CL], "both": ["", CL]}[args.channels_last]
    configs = [(s + v, n, command(s, n, args) + ["--channels-last"] * bool(v))
               for v in variants for s in args.scripts for n in args.world_sizes
               if command(s, n, args) is not None]
    if not configs:
        sys.exit("error: no script runs at these world sizes with this --amp")
    results = {(s, n): [] for s, n, _ in configs}

    def threads(n):  # each process's share of the cores
        return max(1, len(os.sched_getaffinity(0)) // n)
    for rep in range(args.reps):
        for s, n, cmd in configs:
            print(f"rep {rep + 1}/{args.reps}: {s} x{n}", file=sys.stderr, flush=True)
            results[(s, n)].append(run_once(cmd, threads(n), args, seed=rep))

    print(f"\nMachine: {machine()}")
    print(f"Work: {'synthetic data' if args.dummy else 'MNIST'}, {args.epochs} epoch(s), global "
          f"batch {args.batch_size}, --amp {args.amp}, --channels-last {args.channels_last}, "
          f"{args.reps} seed(s) per row; median "
          f"(min-max)\n")
    print(f"| script | processes x threads | s to {TARGET:g}% | test acc. mean (worst) | "
          "epoch s | samples/s | data wait | DDP efficiency | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (s, n), rs in results.items():
        ones = results.get((s, 1))
        eff = "-"
        if not s.startswith("dp_baseline") and n > 1 and ones:  # throughput at N / throughput at 1
            eff = f"{statistics.median(r['samples_s'] for r in rs) / statistics.median(r['samples_s'] for r in ones):.2f}"
        reached = sum(r["to_target"] is not None for r in rs)
        accs = [r["acc"] for r in rs]
        print(f"| {s} | {n} x {threads(n)} | {spread([r['to_target'] for r in rs])}"
              f"{'' if reached == len(rs) else f' ({reached}/{len(rs)} reached)'} | "
              f"{statistics.mean(accs):.2f} ({min(accs):.2f}) | {spread([r['epoch_s'] for r in rs])} | "
              f"{spread([r['samples_s'] for r in rs], '{:.0f}')} | "
              f"{spread([100 * r['data_wait'] for r in rs], '{:.1f}')}% | {eff} | "
              f"{spread([r['wall'] for r in rs])} |")

    def ratio(a, b):  # median epoch time of a / of b, when both ran
        if a in results and b in results:
            ma = statistics.median(r["epoch_s"] for r in results[a])
            mb = statistics.median(r["epoch_s"] for r in results[b])
            return f"{ma / mb:.2f}"
        return None
    lines = []
    for v in variants:
        for s in ("spawn_ddp" + v, "torchrun_ddp" + v):
            r = ratio((s, 2), (s, 1))
            if r:
                lines.append(f"- {s}: epoch time at 2 processes / at 1 process (same global "
                             f"batch): {r}")
            r = ratio((s, 1), ("dp_baseline" + v, 1))
            if r and not torch.cuda.is_available():  # on CPU dp_baseline is the bare loop
                lines.append(f"- {s} at world size 1 / the same loop without DDP (dp_baseline "
                             f"on CPU): {r}")
    for s, n in results:
        if s.endswith(CL):
            r = ratio((s, n), (s[:-len(CL)], n))
            if r:
                lines.append(f"- {s[:-len(CL)]} x{n}: epoch time with --channels-last / "
                             f"without: {r}")
    if lines:
        print("\nRatios of median epoch times, from this run:\n" + "\n".join(lines))
    if args.png:
        save_chart(results, args.png)


def save_chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{s}\nx{n}" for s, n in results]
    medians = [statistics.median(r["epoch_s"] for r in rs) for rs in results.values()]
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 1, 3.5))
    ax.bar(labels, medians)
    ax.set_ylabel("epoch seconds (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nchart: {path}")


if __name__ == "__main__":
    main()
