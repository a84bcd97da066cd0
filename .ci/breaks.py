"""Breaks each promise of the quick loop on purpose, one at a time in a copy of the repo, and
lists the quick-loop tests that fail (docs/maintainers.md, "The quick loop"): those of the
promise it breaks (GUARDS), then any other. About 30 minutes on 2 cores. Exit 1 when a break
fails no test of its promise. Usage: python .ci/breaks.py [OUT.md]"""
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
S, T, F, D = "spawn_ddp.py", "torchrun_ddp.py", "torchrun_fsdp.py", "dp_baseline.py"
CK = "ddpkit/checkpoint.py"
K = {S: "spawn", T: "torchrun_ddp", F: "fsdp", D: "dp_baseline",
     "common.py": "spawn or torchrun_ddp or fsdp"}
SCRIPTS = (S, T, F)
SIGTERM = "test_sigterm_saves_where_all_stop_and_resume_is_bit_identical"
ORDER = "test_each_process_trains_its_own_shard_in_a_new_order_each_epoch"
COUNTED = "test_every_test_sample_is_counted_once_by_the_saved_model"
REDUCTION = "test_one_gradient_reduction_per_optimizer_step"
WRITES = "test_one_process_writes_whole_checkpoints_that_load_weights_only"
CURVE = "test_tensorboard_shows_one_curve_across_the_stop_with_the_numbers_of_metrics"
GUARDS = {  # the promise: the quick loop's tests of it (docs/maintainers.md, "The quick loop")
    "a new order each epoch": (ORDER,),
    "its own shard": (ORDER,),
    "the loss averaged": ("test_the_loss_is_averaged_over_all_processes",),
    "each test sample once": (COUNTED,),
    "the position resumed": (SIGTERM, REDUCTION,
                             "test_resume_skips_in_the_sampler_without_loading_the_skipped_samples"),
    "the SIGTERM snapshot's position": (SIGTERM,),
    "one reduction a step": (REDUCTION,),
    "the atomic write": ("test_a_failed_write_leaves_the_previous_checkpoint_whole", WRITES,
                         SIGTERM),
    "the weights-only read": ("test_a_checkpoint_is_read_weights_only", WRITES),
    "the run's identity": ("test_a_resume_with_other_flags_is_refused_in_one_line",
                           "test_a_fresh_run_never_overwrites_a_checkpoint",
                           "test_one_process_resumes_only_when_asked_and_found"),
    "one TensorBoard writer": (CURVE, "test_tensorboard_curves_go_on_after_a_resume_each_step_once"),
    "the curves go on after a resume": (
        CURVE, "test_tensorboard_curves_go_on_after_a_resume_each_step_once"),
    "the checkpoint read once a process": ("test_each_process_reads_the_checkpoint_once",),
    "no batch of one for BatchNorm": (
        "test_a_last_batch_too_small_for_batchnorm_is_left_out_the_same_after_a_resume",),
    "BatchNorm's buffers at evaluation": (COUNTED, "test_the_replicas_end_identical", SIGTERM),
}
BREAKS = [  # (the promise, the file, a line as it is, the line broken[, the tests' -k])
    *(("a new order each epoch", s, "        sampler.set_epoch(epoch)", "        pass") for s in SCRIPTS),
    ("a new order each epoch", D, "sampler.generator.manual_seed(args.seed + epoch)",
     "sampler.generator.manual_seed(args.seed)"),
    *(("its own shard", s, "DistributedSampler(train_set, world_size, rank,",
       "DistributedSampler(train_set, world_size, 0,") for s in SCRIPTS),
    *(("the loss averaged", s, "train_loss = common.reduce_tensor(stats.loss_sum).item()",
       "train_loss = stats.loss_sum.item()") for s in SCRIPTS),
    ("the loss averaged", D, "train_loss = stats.loss_sum.item() / stats.seen",
     "train_loss = stats.loss_sum.item() / steps"),
    *(("each test sample once", s, "sampler=range(rank, len(test_set), world_size)",
       "sampler=range(len(test_set))") for s in SCRIPTS),
    ("each test sample once", "common.py", "dist.all_reduce(totals, op=dist.ReduceOp.SUM)", "pass"),
    *(("the position resumed", s, "loader.sampler.skip = step * batch_size",
       "loader.sampler.skip = 0") for s in (*SCRIPTS, D)),
    *(("the SIGTERM snapshot's position", s, "save(epoch, step - 1)", "save(epoch, step)")
      for s in (*SCRIPTS, D)),
    *(("one reduction a step", s, "with nullcontext() if last else ddp.no_sync():",
       "with nullcontext():") for s in (S, T)),
    ("one reduction a step", F, "set_requires_gradient_sync(last)", "set_requires_gradient_sync(True)"),
    ("the atomic write", CK, 'tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"', "tmp = str(path)"),
    ("the atomic write", CK, 'folder = f"{path}.{int(name):08x}"', "folder = path", "fsdp"),
    ("the weights-only read", CK, "weights_only=True, mmap=True", "weights_only=False, mmap=True"),
    ("the run's identity", CK, "differ = [differs(", "differ = [] and [differs("),
    ("one TensorBoard writer", "ddpkit/reporting.py", "if self.on and args.tensorboard",
     "if args.tensorboard", "spawn or torchrun_ddp or fsdp or tensorboard"),
    ("the curves go on after a resume", "ddpkit/reporting.py", "purge_step=epoch * steps + step + 1",
     "purge_step=None", "tensorboard"),
    ("the checkpoint read once a process", CK, "ckpt = read if then == stat(path) else load(path)",
     "ckpt = load(path)", "torchrun_ddp or reads_the_checkpoint"),
    ("no batch of one for BatchNorm", "ddpkit/data.py", "return 0 < shard % batch < 2 * accumulate",
     "return False", "last_batch"),
    ("BatchNorm's buffers at evaluation", "common.py", "            dist.broadcast(b, src=0)\n",
     "            pass\n"),
    ("BatchNorm's buffers at evaluation", CK, "        dist.broadcast(b, src=0)  #", "        pass  #",
     "fsdp"),
]
FILES = ["tests/test_smoke.py", "tests/test_common.py", "tests/test_same_run.py",
         "tests/test_cluster_safety.py", "tests/test_shutdown.py"]

rows, missed = [], 0
for promise, name, line, broken, *k in BREAKS:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".venv"))
        text = (copy / name).read_text()
        assert line in text, f"{name} no longer has {line!r}: update .ci/breaks.py"
        (copy / name).write_text(text.replace(line, broken))
        k = k[0] if k else K.get(name, "")  # "": every test of FILES
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
               "-n", "2", "--dist", "loadfile", *FILES]
        cmd += ["-k", f"{k} or not (spawn or torchrun or fsdp or dp_baseline)"] if k else []
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True)
    failed = sorted({f.split("/")[-1] for f in re.findall(r"^FAILED (\S+)", r.stdout, re.M)})
    ours = [f for f in failed if f.split("::")[-1].split("[")[0] in GUARDS[promise]]
    missed += not ours  # caught only by a test of the promise it breaks
    others = [f for f in failed if f not in ours]
    rows.append(f"| {promise} | `{name}` | {', '.join(ours) or 'NOTHING'} |"
                f" {', '.join(others)} |")
    print(rows[-1], flush=True)
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text("\n".join(rows) + "\n")
sys.exit(1 if missed else 0)
