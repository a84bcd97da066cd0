"""Breaks each promise of the quick loop on purpose, one at a time in a copy of the repo, and
lists the quick-loop tests that fail (docs/maintainers.md, "The quick loop"). About 25 minutes
on 2 cores. Exit 1 when a break fails no test. Usage: python .ci/breaks.py [OUT.md]"""
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
S, T, F, CK = "spawn_ddp.py", "torchrun_ddp.py", "torchrun_fsdp.py", "ddpkit/checkpoint.py"
K = {S: "spawn", T: "torchrun_ddp", F: "fsdp", "common.py": "spawn or torchrun_ddp or fsdp"}
SCRIPTS = (S, T, F)
BREAKS = [  # (the promise, the file, a line as it is, the line broken[, the tests' -k])
    *(("a new order each epoch", s, "        sampler.set_epoch(epoch)", "        pass") for s in SCRIPTS),
    *(("its own shard", s, "DistributedSampler(train_set, world_size, rank,",
       "DistributedSampler(train_set, world_size, 0,") for s in SCRIPTS),
    *(("the loss averaged", s, "train_loss = common.reduce_tensor(stats.loss_sum).item()",
       "train_loss = stats.loss_sum.item()") for s in SCRIPTS),
    *(("each test sample once", s, "sampler=range(rank, len(test_set), world_size)",
       "sampler=range(len(test_set))") for s in SCRIPTS),
    ("each test sample once", "common.py", "dist.all_reduce(totals, op=dist.ReduceOp.SUM)", "pass"),
    *(("the position resumed", s, "loader.sampler.skip = step * batch_size",
       "loader.sampler.skip = 0") for s in SCRIPTS),
    *(("the SIGTERM snapshot's position", s, "save(epoch, step - 1)", "save(epoch, step)")
      for s in SCRIPTS),
    *(("one reduction a step", s, "with nullcontext() if last else ddp.no_sync():",
       "with nullcontext():") for s in (S, T)),
    ("one reduction a step", F, "set_requires_gradient_sync(last)", "set_requires_gradient_sync(True)"),
    ("the atomic write", CK, 'tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"', "tmp = str(path)"),
    ("the atomic write", CK, 'folder = f"{path}.{int(name):08x}"', "folder = path", "fsdp"),
    ("the weights-only read", CK, "weights_only=True, mmap=True", "weights_only=False, mmap=True"),
    ("the run's identity", CK, "differ = [differs(", "differ = [] and [differs("),
    ("one TensorBoard writer", "ddpkit/reporting.py", "if self.on and self.args.tensorboard",
     "if self.args.tensorboard", "spawn or torchrun_ddp or fsdp or tensorboard"),
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
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        text = (copy / name).read_text()
        assert line in text, f"{name} no longer has {line!r}: update .ci/breaks.py"
        (copy / name).write_text(text.replace(line, broken))
        k = k[0] if k else K.get(name, "")  # "": every test of FILES
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
               "-n", "2", "--dist", "loadfile", *FILES]
        cmd += ["-k", f"{k} or not (spawn or torchrun or fsdp)"] if k else []
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True)
    failed = sorted({f.split("/")[-1] for f in re.findall(r"^FAILED (\S+)", r.stdout, re.M)})
    missed += not failed
    rows.append(f"| {promise} | `{name}` | {', '.join(failed) or 'NOTHING'} |")
    print(rows[-1], flush=True)
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text("\n".join(rows) + "\n")
sys.exit(1 if missed else 0)
