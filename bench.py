"""Run the launch styles side by side on the same work and print one markdown table.

Every configuration runs through its real command line with the same seed, global batch and
epochs, and reports through --metrics. Repetitions are interleaved (rep 1 of every
configuration, then rep 2, ...) with seeds 0, 1, 2, ..., so slow spells of a shared machine
hit all configurations alike; every ratio comes from this one run. An option given several
values (or `both`) runs each value side by side, and the report adds the ratio of each to the
first.

    python bench.py --data-dir ../shared/data      # the default against fp32 NCHW (docs/speed.md)
    python bench.py --data-dir ../shared/data --amp none bf16 --reps 5
    python bench.py --data-dir ../shared/data --channels-last both    # NCHW and NHWC side by side
    python bench.py --data-dir ../shared/data --workers 0 2           # data-loading processes
    python bench.py --data-dir ../shared/data --checkpoint both       # the SIGTERM agreement
    python bench.py --data-dir ../shared/data --compile both --epochs 2  # eager and compiled
    python bench.py --data-dir ../shared/data --against ../old-checkout  # another commit's scripts
    python bench.py --dummy --reps 1 --scripts spawn_ddp --world-sizes 1 2
    python bench.py --target "test_rmse<=0.5" --data-dir my/data   # another task's metric

Flags that bench.py does not know (the task's: --data-dir, --dummy, ...) go to every script.
"""
import argparse
import functools
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

import common
from ddpkit import flags, launch, machine

ROOT = Path(__file__).resolve().parent
SCRIPTS = ("dp_baseline", "spawn_ddp", "torchrun_ddp", "apex_ddp", "torchrun_fsdp")
ENV = "+env"  # the row label of a run with the --with-env variables
BOTH = {"off": [False], "on": [True], "both": [False, True], "default": [None]}


def command(script, world_size, v):
    """The real command line of one launch style at one world size for variant `v` (None: not
    applicable). auto, the scripts' default, is not passed: scripts older than it (--against)
    then run their own default, fp32."""
    amp, repo = "none" if v["baseline"] else v["amp"], v["repo"]
    precision = [] if amp == "auto" else ["--amp", amp]
    if script == "dp_baseline":
        return [sys.executable, f"{repo}/dp_baseline.py", *precision] if world_size == 1 else None
    if script == "spawn_ddp":
        return [sys.executable, f"{repo}/spawn_ddp.py", "--nproc-per-node", str(world_size),
                *precision]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={world_size}"]
    if script in ("torchrun_ddp", "torchrun_fsdp"):
        found = Path(repo, f"{script}.py").exists()  # an --against tree may predate FSDP
        return [*torchrun, f"{repo}/{script}.py", *precision] if found else None
    # apex_ddp.py picks precision by --opt-level: O0 is fp32; natively O1 is fp16 on GPUs, bf16
    # on a CPU with bf16 instructions and fp32 on other CPUs
    native_o1 = ("fp16" if torch.cuda.is_available() else
                 "bf16" if machine.computes_bf16(None)[0] else "none")
    if amp not in ("auto", "none", native_o1):  # auto: O1, which picks as --amp auto does
        return None
    return [*torchrun, f"{repo}/apex_ddp.py", "--opt-level", "O0" if amp == "none" else "O1"]


def run_once(cmd, threads, args, seed, v):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        full = [*cmd, *args.task, "--seed", str(seed), "--epochs", str(args.epochs),
                "--batch-size", str(v["batch"]), "--lr-scaling", v["rule"],
                "--log-interval", str(10 ** 9), "--metrics", str(metrics)]
        layout = False if v["baseline"] else v["channels_last"]  # None: the task's default
        if layout is False and not knows_no_channels_last(v["repo"]):
            layout = None  # older scripts (--against) had --channels-last alone, off by default
        full += {True: ["--channels-last"], False: ["--no-channels-last"], None: []}[layout]
        full += ["--compile"] * v["compile"]
        full += ["--workers", str(v["workers"])] if v["workers"] is not None else []
        full += ["--checkpoint", f"{tmp}/c"] if v["checkpoint"] else []  # a file, or FSDP's folder
        env = dict(os.environ, **v["env"], OMP_NUM_THREADS=str(threads))  # alike for all
        start = time.perf_counter()
        p = subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.timeout)
        wall = time.perf_counter() - start
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
            raise common.Fatal(f"{' '.join(full)} exited with {p.returncode}:\n{tail}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metric, op, target = args.target
    if metric not in rows[-1]:
        raise common.Fatal(f"--target {metric}: the scripts report no such metric; they report "
                           f"{', '.join(k for k in rows[-1] if k not in ('epoch', 'world_size'))}")
    elapsed, to_target = 0.0, None
    for r in rows:
        elapsed += r["epoch_seconds"]
        if to_target is None and (r[metric] >= target if op == ">=" else r[metric] <= target):
            to_target = elapsed
    return {"to_target": to_target, "acc": rows[-1][metric], "wall": wall,
            "startup": wall - elapsed, "first_s": rows[0]["epoch_seconds"],  # first: compiles
            "later_s": (statistics.mean(r["epoch_seconds"] for r in rows[1:])
                        if len(rows) > 1 else None),
            "accs": [r[metric] for r in rows],
            "epoch_s": statistics.mean(r["epoch_seconds"] for r in rows),
            "samples_s": statistics.mean(r["samples_per_s"] for r in rows),
            "data_wait": statistics.mean(r["data_wait"] for r in rows)}


@functools.cache
def knows_no_channels_last(repo):
    """Whether the scripts in `repo` have --no-channels-last (older ones do not)."""
    return any("--no-channels-last" in f.read_text() for f in Path(repo).glob("*.py")
               if f.name != "bench.py")


def spread(values, fmt="{:.1f}"):
    """median (min-max) of the values that exist."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def this_machine():
    """The CPU with the features that decide which precision pays (see machine.computes_bf16)."""
    caps = getattr(torch.cpu, "get_capabilities", dict)()  # torch 2.4 has none
    cpu = caps.get("cpu_name") or platform.processor() or platform.machine()
    names = {"x86_64": (("AVX-512", "avx512_f"), ("AVX512_BF16", "avx512_bf16"),
                        ("AMX", "amx_bf16")),
             "arm64": (("BF16", "bf16"), ("SVE", "sve"))}.get(caps.get("architecture"), ())
    features = ", ".join(f"{name} {'yes' if caps.get(key) else 'no'}" for name, key in names)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu} ({features or 'features unknown'}), {machine.cpu_count()} cores, {gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def main():
    args = parse_args()
    if args.curves:
        return save_curves(args.curves, args.png)
    options, variants, configs = plan(args)
    results = {c: [] for c in configs}
    for rep in range(args.reps):  # interleaved: rep 1 of every configuration, then rep 2, ...
        for s, v, n in configs:
            print(f"rep {rep + 1}/{args.reps}: {name(s, v)} x{n}", file=sys.stderr, flush=True)
            cmd = command(s, n, variants[v])
            results[(s, v, n)].append(run_once(cmd, threads(n), args, rep, variants[v]))
    print(f"\nMachine: {this_machine()}")
    print(f"Work: task flags '{' '.join(args.task)}', {args.epochs} epoch(s), global "
          f"batch {' '.join(map(str, args.batch_size))}, --lr-scaling "
          f"{' '.join(args.lr_scaling)}, --amp {' '.join(args.amp)}, "
          f"--channels-last {args.channels_last}, "
          f"{'fp32-nchw: --amp none --no-channels-last, ' if args.baseline == 'on' else ''}"
          f"--compile {args.compile}, --workers {' '.join(map(str, args.workers or ['default']))}, "
          f"--checkpoint {args.checkpoint}, {args.reps} seed(s) per row; median (min-max)"
          + (f"; {ENV}: {args.with_env}" if args.with_env else "")
          + (f"; @{args.against}: the scripts there" if args.against else "") + "\n")
    print_table(results, args.target)
    if len(args.batch_size) > 1 or len(args.lr_scaling) > 1:
        print_accuracy_per_epoch(results, variants, args.epochs, args.target)
    print_ratios(results, options, variants, args)
    if args.png:
        save_chart(results, args.png,
                   f"{this_machine()}\n--amp {' '.join(args.amp)}, {args.reps} seed(s)")


def target(text):
    """--target NAME>=VALUE or NAME<=VALUE: a metric of --metrics and the value to reach."""
    match = re.fullmatch(r"(\w+)\s*(>=|<=)\s*(\S+)", text)
    try:
        return match.group(1), match.group(2), float(match.group(3))
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected NAME>=VALUE or NAME<=VALUE, got {text!r}")


def parse_args():
    p = flags.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=target, default="test_acc>=99", help="the metric and value "
                   "whose time to reach the table shows, and whose mean and worst it shows "
                   "(default: test_acc>=99)")
    p.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    p.add_argument("--world-sizes", nargs="+", type=flags.positive_int, default=[1, 2])
    p.add_argument("--amp", nargs="+", choices=["auto", "none", "bf16", "fp16"], default=["auto"],
                   help="precision(s); several run side by side (default: auto)")
    p.add_argument("--channels-last", choices=["default", "off", "on", "both"], default="default",
                   help="--channels-last or --no-channels-last: off, on, both side by side, or "
                   "default, the task's own (MNIST's: on) (default: default)")
    p.add_argument("--baseline", choices=["on", "off"], help="also run every configuration "
                   "with --amp none --no-channels-last, fp32 in NCHW, the scripts' default before "
                   "--amp auto, side by side (rows marked fp32-nchw) (default: on when --amp and "
                   "--channels-last are left at their defaults and no other option is compared)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="run with --compile: off, on, or both side by side; the first epoch "
                   "includes the compilation, so give --epochs 2 or more (default: off)")
    p.add_argument("--batch-size", nargs="+", type=flags.positive_int, default=[256],
                   help="global batch; several values run side by side (default: 256)")
    p.add_argument("--lr-scaling", nargs="+", choices=list(common.LR_RULES), default=["sqrt"],
                   help="LR rule(s) to compare (default: sqrt); with several batch sizes or "
                   "rules the report adds test accuracy after every epoch")
    p.add_argument("--workers", nargs="+", type=flags.natural_int, help="--workers of the "
                   "scripts; several values run side by side (default: the scripts' own)")
    p.add_argument("--checkpoint", choices=["off", "on", "both"], default="off",
                   help="run with --checkpoint (in a temporary folder), which also turns "
                   "on the SIGTERM agreement (about once a second): off, on, or both side by side "
                   "(default: off)")
    p.add_argument("--against", metavar="DIR", help="also run every configuration with the "
                   "scripts in DIR (e.g. a git worktree of another commit), side by side (rows "
                   "marked @DIR)")
    p.add_argument("--with-env", metavar="'NAME=VALUE ...'", help="also run every configuration "
                   "with these environment variables set, side by side (rows marked +env)")
    p.add_argument("--reps", type=flags.positive_int, default=5, help="repetitions, seeds "
                   "0..reps-1 (default: 5)")
    p.add_argument("--epochs", type=flags.positive_int, default=1)
    p.add_argument("--timeout", type=flags.positive_float, default=900, help="seconds per run "
                   "(default: 900)")
    p.add_argument("--png", metavar="PATH", help="also save a chart of the epoch times (needs "
                   "matplotlib)")
    p.add_argument("--curves", metavar="DIR", help="run nothing: draw the curves of a "
                   "--tensorboard folder into --png (needs tensorboard)")
    args, args.task = p.parse_known_args()  # the rest: the task's flags, for every script
    if args.curves and not (args.png and Path(args.curves).is_dir()):
        raise common.Fatal(f"--curves {args.curves}: needs --png PATH and a folder")
    if args.curves and not importlib.util.find_spec("tensorboard"):
        raise common.Fatal("--curves needs tensorboard: pip install tensorboard")
    if args.baseline is None:  # on for the plain table, off where another option is compared
        others = [args.batch_size, args.lr_scaling, args.workers or [0]]
        args.baseline = "on" if args.amp == ["auto"] and args.channels_last == "default" and all(
            len(o) == 1 for o in others) and "both" not in (args.compile, args.checkpoint) \
            and not (args.with_env or args.against) else "off"
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise common.Fatal("--png needs matplotlib: pip install matplotlib") from None
    try:
        args.env = dict(item.split("=", 1) for item in (args.with_env or "").split())
    except ValueError:
        raise common.Fatal(f"--with-env {args.with_env!r}: expected NAME=VALUE pairs") from None
    if args.against and not (Path(args.against) / "spawn_ddp.py").exists():
        raise common.Fatal(f"--against {args.against}: no spawn_ddp.py there")
    return args


def plan(args):
    """The options (each with its values), the variants (one value of every option, by row
    label) and the configurations (script, variant, processes) that can run."""
    options = {"amp": args.amp, "channels_last": BOTH[args.channels_last],
               "baseline": [False, True] if args.baseline == "on" else [False],
               "batch": args.batch_size, "rule": args.lr_scaling,
               "compile": BOTH[args.compile], "workers": args.workers or [None],
               "checkpoint": BOTH[args.checkpoint],
               "env": [{}, args.env] if args.env else [{}],
               "repo": [str(ROOT)] + ([args.against] if args.against else [])}
    variants = {}
    for values in itertools.product(*options.values()):
        v = dict(zip(options, values))
        if v["baseline"] and (v["amp"], v["channels_last"]) != (args.amp[0], options[
                "channels_last"][0]):
            continue  # the baseline sets both: once
        variants[label(v, options)] = v
    configs = [(s, v, n) for v in variants for s in args.scripts for n in args.world_sizes
               if command(s, n, variants[v]) is not None
               and variants[v]["batch"] % n == 0
               and not (s == "dp_baseline" and variants[v]["compile"])]  # DDP scripts only
    if not configs:
        raise common.Fatal("no script runs at these world sizes with this --amp")
    return options, variants, configs


def threads(n):
    """Each process's share of the cores."""
    return max(1, machine.cpu_count() // n)


def name(s, v):
    return f"{s} {v}".strip()


def print_table(results, target):
    metric, op, value = target
    print(f"| script | processes x threads | s to {metric} {op} {value:g} | "
          f"{metric} mean (worst) | epoch s | samples/s | data_wait | DDP efficiency | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (s, v, n), rs in results.items():
        ones = results.get((s, v, 1))
        eff = "-"
        if s != "dp_baseline" and n > 1 and ones:  # throughput at N / throughput at 1
            eff = f"{median(rs, 'samples_s') / median(ones, 'samples_s'):.2f}"
        reached = sum(r["to_target"] is not None for r in rs)
        accs = [r["acc"] for r in rs]
        worst = min(accs) if op == ">=" else max(accs)
        print(f"| {name(s, v)} | {n} x {threads(n)} | {spread([r['to_target'] for r in rs])}"
              f"{'' if reached == len(rs) else f' ({reached}/{len(rs)} reached)'} | "
              f"{statistics.mean(accs):.4g} ({worst:.4g}) | {spread([r['epoch_s'] for r in rs])} | "
              f"{spread([r['samples_s'] for r in rs], '{:.0f}')} | "
              f"{spread([r['data_wait'] for r in rs], '{:.3f}')} | {eff} | "
              f"{spread([r['wall'] for r in rs])} |")


def print_accuracy_per_epoch(results, variants, epochs, target):
    """How each batch size and LR rule learns, epoch by epoch."""
    worst = min if target[1] == ">=" else max
    print(f"\n{target[0]} after each epoch, mean (worst) over the seeds:\n")
    print("| script | processes | global batch | LR rule | peak LR | "
          + " | ".join(f"epoch {e + 1}" for e in range(epochs)) + " | epoch s |")
    print("|---|---|---|---|---|" + "---|" * epochs + "---|")
    lr = 0.01  # the scripts' default --lr
    for (s, v, n), rs in results.items():
        batch, rule = variants[v]["batch"], variants[v]["rule"]
        peak = common.peak_lr(argparse.Namespace(lr=lr, batch_size=batch, lr_scaling=rule))
        cells = [f"{statistics.mean(a):.2f} ({worst(a):.2f})"
                 for a in zip(*(r["accs"] for r in rs))]
        print(f"| {name(s, v)} | {n} | {batch} | {rule} | {peak:.4g} | {' | '.join(cells)} | "
              f"{spread([r['epoch_s'] for r in rs])} |")


def median(rs, key):
    return statistics.median(r[key] for r in rs)


def print_ratios(results, options, variants, args):
    """Median epoch times against each other: 2 processes against 1, DDP against the bare loop,
    and each option's other values against its first, all else alike."""
    def ratio(a, b):
        return f"{median(results[a], 'epoch_s') / median(results[b], 'epoch_s'):.2f}"
    lines = []
    for v in variants:
        for s in ("spawn_ddp", "torchrun_ddp"):
            if (s, v, 2) in results and (s, v, 1) in results:
                lines.append(f"- {name(s, v)}: epoch time at 2 processes / at 1 process (same "
                             f"global batch): {ratio((s, v, 2), (s, v, 1))}")
            if (s, v, 1) in results and ("dp_baseline", v, 1) in results \
                    and not torch.cuda.is_available():  # on CPU dp_baseline is the bare loop
                lines.append(f"- {name(s, v)} at world size 1 / the same loop without DDP "
                             f"(dp_baseline on CPU): {ratio((s, v, 1), ('dp_baseline', v, 1))}")
    for s, v, n in results:
        for option, values in options.items():
            plain = label(dict(variants[v], **{option: values[0]}), options)
            if variants[v][option] == values[0] or (s, plain, n) not in results:
                continue
            if option == "compile":
                lines.append(f"- {name(s, plain)} x{n}: " + compile_cost(results[(s, v, n)],
                                                                         results[(s, plain, n)]))
                continue
            what, without = {
                "amp": (f"--amp {variants[v]['amp']}", f"--amp {values[0]}"),
                "channels_last": ("--channels-last", "without"),
                "baseline": ("fp32-nchw (--amp none --no-channels-last)", "without"),
                "workers": (f"--workers {variants[v]['workers']}", f"--workers {values[0]}"),
                "checkpoint": ("--checkpoint (the SIGTERM agreement)", "without"),
                "env": (ENV, "without"), "repo": (f"@{args.against}", "the scripts here"),
                "batch": (f"batch {variants[v]['batch']}", f"batch {values[0]}"),
                "rule": (variants[v]["rule"], values[0])}[option]
            without = without if without == "without" else f"with {without}"
            lines.append(f"- {name(s, plain)} x{n}: epoch time with {what} / {without}: "
                         f"{ratio((s, v, n), (s, plain, n))}")
    if lines:
        print("\nRatios of median epoch times, from this run:\n" + "\n".join(lines))


def label(v, options):
    """A variant's row label: the values of the options that have several, in words."""
    several = len(options["batch"]) > 1 or len(options["rule"]) > 1
    own = not v["baseline"]  # the baseline sets the precision and the layout itself
    parts = [v["amp"] if len(options["amp"]) > 1 and own else "",
             f"batch {v['batch']} {v['rule']}" if several else "",
             "+channels_last" if v["channels_last"] and own else "",
             "-channels_last" if v["channels_last"] is False and len(options["channels_last"]) > 1
             and own else "", "" if own else "fp32-nchw", "+compile" if v["compile"] else "",
             f"workers {v['workers']}" if len(options["workers"]) > 1 else "",
             "+checkpoint" if v["checkpoint"] else "", ENV if v["env"] else "",
             f"@{v['repo']}" if v["repo"] != options["repo"][0] else ""]
    return " ".join(filter(None, parts))


def compile_cost(compiled, eager):
    """--compile against the same configuration without it: the first epoch (compilation
    included), the later ones (compiled code only), and the start-up outside the epochs."""
    def med(rs, key):
        values = [r[key] for r in rs if r[key] is not None]
        return statistics.median(values) if values else None
    first = (f"first epoch {med(compiled, 'first_s'):.1f} s with --compile / "
             f"{med(eager, 'first_s'):.1f} s without")
    later = ""
    if med(compiled, "later_s") is not None:
        c, e = med(compiled, "later_s"), med(eager, "later_s")
        later = (f"; later epochs {c:.1f} s / {e:.1f} s (ratio {c / e:.2f}); compilation about "
                 f"{med(compiled, 'first_s') - c:.0f} s (first epoch - later ones)")
    return (first + later + f"; start-up outside the epochs {med(compiled, 'startup'):.1f} s / "
            f"{med(eager, 'startup'):.1f} s")


def save_chart(results, path, title):
    """Median epoch seconds: one group of bars per script and process count, one colour per
    variant (channels_last, batch size, LR rule), the min-max range as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(dict.fromkeys((s, n) for s, _, n in results))
    variants = list(dict.fromkeys(v for _, v, _ in results))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(1.3 * len(groups) + 2, 3.8))
    for i, v in enumerate(variants):
        xs, meds, lo, hi = [], [], [], []
        for g, (s, n) in enumerate(groups):
            rs = results.get((s, v, n))
            if rs:
                times = [r["epoch_s"] for r in rs]
                xs.append(g + (i - (len(variants) - 1) / 2) * width)
                meds.append(statistics.median(times))
                lo.append(meds[-1] - min(times))
                hi.append(max(times) - meds[-1])
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=v or "default")
    ax.set_xticks(range(len(groups)), [f"{s}\nx{n}" for s, n in groups], fontsize=8)
    ax.set_ylabel("epoch seconds (median)")
    ax.set_title(title, fontsize=8)
    if len(variants) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nchart: {path}")


def read_curves(where):
    """{tag: [(step, value), ...]} of a --tensorboard folder (or one event file), as
    TensorBoard's own reader keeps them: a restarted writer's purge_step applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(where), size_guidance={"scalars": 0})  # 0: all of them
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


def save_curves(folder, path):
    """A --tensorboard folder as TensorBoard reads it: the loss at each logged step and each
    epoch's, the first test metric on its own axis, and a dashed line where each later run
    (a resume) began to write. Returns those runs' first steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = read_curves(folder)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for tag, style in (("step/train_loss", "-"), ("epoch/train_loss", "o")):
        if tag in curves:  # (no step curve where --log-interval exceeds an epoch)
            ax.plot(*zip(*curves[tag]), style, lw=1, label=tag)
    ax.set_xlabel("global step")
    ax.set_ylabel("training loss")
    lines = ax.get_lines()
    tests = [t for t in curves if t.startswith("epoch/test_")]
    if tests:
        right = ax.twinx()
        lines += right.plot(*zip(*curves[tests[0]]), "s", color="tab:green", label=tests[0])
        right.set_ylabel(tests[0].split("/")[1])
    starts = sorted(read_curves(f).get("step/train_loss", [(None,)])[0][0]
                    for f in Path(folder).glob("events.out.tfevents.*"))
    for step in [s for s in starts if s][1:]:
        ax.axvline(step - 0.5, ls="--", color="gray")
        ax.annotate(f" resumed: step {step} on", (step, sum(ax.get_ylim()) / 2), fontsize=8)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")
    return starts[1:]


if __name__ == "__main__":
    with launch.clean_exit():
        main()
