"""The checkpoint: what it holds, written by one process and read by all (a file), or by every
process its shards (torchrun_fsdp.py's DCP folder), checked (a checkpoint continues its own run
only, and fits the model), agreed (whether and from where the processes resume, together) and
restored. docs/preemption.md, docs/fsdp.md."""
import json
import os
import re
from collections import OrderedDict
import secrets
import shutil
import zlib

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import common
from common import Fatal

from . import machine


# ---- The file: written once, atomically; read on the CPU, weights only ------------------

def state(model, optimizer, scheduler, scaler, epoch, step, args):
    """Plain tensors and values only. `epoch` epochs done, plus `step` steps of the next one."""
    return {"model": model.state_dict(),  # the plain model: no "module." prefix
            "optimizer": optimizer.state_dict(), **progress(scheduler, scaler, epoch, step, args)}


def progress(scheduler, scaler, epoch, step, args):
    """Everything but the weights: plain values, JSON's too (the sharded form's RUN_JSON)."""
    return {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
            "step": step, "args": vars(args)}


def save(state, path):
    """A temporary file of this writer's own in the same folder, on the disk, renamed over `path`:
    a crash, a kill or a full disk leaves the previous checkpoint whole; writers never collide."""
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            torch.save(state, f)  # a file, not a path: a failed write is an OSError of Python's
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save raises the zip writer's RuntimeError,
        cause = e.__context__ if isinstance(e, RuntimeError) else e  # the OSError its context
        if os.path.exists(tmp):
            os.remove(tmp)
        if not isinstance(cause, OSError):
            raise
        raise Fatal(f"could not write the checkpoint {path} ({cause.strerror or cause}); the "
                    "previous one, if any, is intact") from None


def load(path):
    """The checkpoint's tensors on the CPU, mapped from the file, not copied (processes on one
    machine share its pages); weights_only, as unpickling arbitrary objects could run code.
    A folder's (the sharded form): its JSON alone; `restore` reads its shards."""
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, RUN_JSON)) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise Fatal(f"--checkpoint {path} is not a checkpoint of torchrun_fsdp.py ({RUN_JSON}"
                        f": {e.strerror if isinstance(e, OSError) else e})") from None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise Fatal(f"checkpoint {path} is corrupt or truncated ({common.reason(e)[:200]})") \
            from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise Fatal(f"{path} is not a checkpoint of these scripts (no 'model' entry)")
    return ckpt


# ---- The sharded form: a DCP folder, every process writing its own shards ------------------
# --checkpoint DIR is a link to a folder beside it, DIR.<8 hex digits>, a new name each save.
# Every process writes the new folder, then the link is replaced (a rename: atomic), and only
# then are the older folders deleted: a kill at any moment leaves a whole snapshot at DIR. No
# process reads the link to choose (a stale view of it, on NFS, would choose the live one).
# Model and optimizer in DCP's files; the rest in RUN_JSON.

RUN_JSON = "run.json"


def save_sharded(model, optimizer, scheduler, scaler, epoch, step, args):
    """By every process: its shards of the model and optimizer state. (DCP is imported where it
    is used: 0.8 s of imports here, that the DDP scripts need not pay.)"""
    from torch.distributed.checkpoint import CheckpointException, save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    path, rank = args.checkpoint, dist.get_rank()
    for b in model.buffers():  # rank 0's BatchNorm statistics, the model DDP saves (each
        dist.broadcast(b, src=0)  # process updates its own; DCP would write any process's)
    name = torch.tensor(secrets.randbits(31), device=next(model.parameters()).device)
    dist.broadcast(name, src=0)  # rank 0's draw: one new folder for all (not torch's seeded RNG)
    folder = f"{path}.{int(name):08x}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        if rank == 0:
            with open(os.path.join(folder, RUN_JSON), "x") as f:
                json.dump(progress(scheduler, scaler, epoch, step, args), f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.isdir(path) and not os.path.islink(path):  # a folder copied here: out
                os.replace(path, f"{path}.{secrets.randbits(32):08x}")  # of the link's way
            link = f"{path}.{secrets.token_hex(4)}.tmp"
            os.symlink(os.path.basename(folder), link)
            os.replace(link, path)
            parent, base = os.path.split(os.path.abspath(path))
            ours = re.compile(re.escape(base) + r"\.([01]|[0-9a-f]{8})(\.tmp)?")
            for old in os.listdir(parent):  # older snapshots, unfinished ones, and links
                old = os.path.join(parent, old)
                if ours.fullmatch(os.path.basename(old)) and old != os.path.abspath(folder):
                    os.remove(old) if os.path.islink(old) else shutil.rmtree(old, True)
    except (OSError, CheckpointException) as e:  # DCP's (a BaseException): every process's
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        if isinstance(cause, OSError):
            why = cause.strerror or cause
        elif "inline_container" in str(cause):  # torch's writer, whose OSError DCP drops
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            why = f"{common.reason(cause)}; {free / 2**20:.1f} MiB free on its disk"
        else:
            raise cause from None
        raise Fatal(f"could not write the checkpoint {path} ({why}); the previous one, if any, "
                    "is intact") from None
    dist.barrier()  # nobody runs ahead, or exits, before the checkpoint is complete


def check_links(path):
    """A save replaces the link DIR by a rename: a filesystem without links or that rename (FAT,
    some SMB and FUSE mounts) is refused at the start, not at the first save."""
    probes = [f"{path}.{secrets.token_hex(4)}.tmp" for _ in range(2)]  # (a save deletes them)
    try:
        for probe in probes:
            os.symlink(".", probe)
        os.replace(*probes)
        os.remove(probes[1])
    except OSError as e:
        [os.remove(p) for p in probes if os.path.lexists(p)]
        raise Fatal(f"--checkpoint {path}: torchrun_fsdp.py's checkpoint is a link replaced by a "
                    f"rename, which its filesystem refuses ({e.strerror}); give a path on another "
                    "one") from None


def restore_sharded(model, optimizer, path):
    from torch.distributed.checkpoint import CheckpointException, load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    both = {"model": model_state, "optimizer": optimizer_state}
    try:
        load(both, checkpoint_id=path)  # each process reads its shards, at any world size
    except CheckpointException as e:  # (a BaseException) every process's errors, gathered
        cause = next(iter(e.failures.values()))[0]
        raise Fatal(f"checkpoint {path} is corrupt or incomplete ({common.reason(cause)})") \
            from None
    set_state_dict(model, optimizer, model_state_dict=both["model"],
                   optim_state_dict=both["optimizer"])


def fits_sharded(model, path):
    """Refuses a folder whose model entries differ from `model`'s in name or shape."""
    from torch.distributed.checkpoint import FileSystemReader
    saved = {k[len("model."):]: tuple(m.size) for k, m in FileSystemReader(path).read_metadata()
             .state_dict_metadata.items() if k.startswith("model.") and hasattr(m, "size")}
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    differ = sorted(k for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k))
    if differ:
        raise Fatal(f"checkpoint {path} does not fit this model: " + ", ".join(
            f"{k} {saved.get(k, 'missing')} in the checkpoint, {mine.get(k, 'missing')} here"
            for k in differ[:3]))


# ---- Resuming together, the same run only --------------------------------------------------

NO_RESUME, RESUME_IF_FOUND, RESUME = 0, 1, 2  # what one process asks for
# The flags that do not define a run: where files go, how the job is spread, started and
# reported, how fast it runs, and what this one invocation does. Every other flag defines it,
# a task's own too, except a task's flag named --*-dir, --*-path or --*-file (where its data
# is, not what). docs/preemption.md#one-run-one-checkpoint says why each is where it is.
NOT_THE_RUN = {"stop_after", "workers", "channels_last", "compile", "checkpoint", "save_every",
               "resume", "evaluate", "metrics", "tensorboard", "log_interval",
               "save_on_each_node", "timeout", "step_timeout", "join_timeout", "nproc_per_node",
               "nnodes", "node_rank", "master_addr", "master_port", "local_rank", "gpus",
               "native"}


def run_flags(args):
    """The flags that define the run of `args`, as {dest: value}; --amp auto is the checkpoint's
    precision when resuming (`agreed`), so it is not compared."""
    return {k: v for k, v in vars(args).items() if k not in NOT_THE_RUN
            and not k.endswith(("_dir", "_path", "_file")) and (k, v) != ("amp", "auto")}


def check_same_run(args, ckpt, path):
    """Refuses, in one line, to continue a checkpoint that another run wrote: every flag that
    defines the run and that both know, with the value in the checkpoint and the value now.
    --evaluate compares the task alone, which the checkpoint names but never chooses."""
    then = ckpt.get("args", {})
    if args.evaluate:
        if not same_task(then.get("task", args.task), args.task):
            mine, theirs = (f"--task {t}" if t else "no --task (MNIST)"
                            for t in (args.task, then["task"]))
            raise Fatal(f"{path} was trained with {theirs}, this run has {mine}: evaluate it "
                        f"with {theirs}")
        return
    differ = [differs(k, then[k], v) for k, v in sorted(run_flags(args).items())
              if k in then and then[k] != v and not (k == "task" and same_task(then[k], v))]
    if differ:
        raise Fatal(f"{path} is the checkpoint of another run: {'; '.join(differ)}. Give its "
                    "flags to continue it, or another --checkpoint to start a new run")


def same_task(then, now):
    """Whether two --task values name one task: the same file however it is spelled (relative or
    absolute, through a link), or where the checkpoint's file is not here (another machine or
    folder), a file of the same name (the module it is imported as); a module, by its name."""
    if then == now or not (then and now and then.endswith(".py") and now.endswith(".py")):
        return then == now
    if os.path.isfile(then) and os.path.isfile(now):  # a relative path: from here, as trained
        return os.path.samefile(then, now)
    return os.path.basename(then) == os.path.basename(now)


def differs(dest, then, now):
    """"--batch-size 256 in the checkpoint, 128 now"; "--dummy now, not in the checkpoint"."""
    flag = "--" + dest.replace("_", "-")
    if isinstance(then, bool) or isinstance(now, bool):
        return f"{flag} {'in the checkpoint, not now' if then else 'now, not in the checkpoint'}"
    return f"{flag} {then if then is not None else '(not given)'} in the checkpoint, " \
           f"{now if now is not None else '(not given)'} now"


READ = {}  # path: (its stat, what check_file read), for `agreed` in this process: one read


def stat(path):
    s = os.stat(path)  # through the link of the sharded form: the folder it points to
    return s.st_ino, s.st_mtime_ns, s.st_size


def check_file(args, task, place, keep=False, model=None):
    """Before the processes meet (flags.check_args), the checkpoint to resume or evaluate is read,
    compared with this run and fitted to the model's shapes on the meta device (no memory, no
    data). Absent, it is refused on one machine; on several, another node may hold it. `keep`:
    this process trains, and `agreed` takes what was read unless the file changed since. `model`:
    the task's, on the meta device, where the caller built it already."""
    path = args.checkpoint
    if not os.path.exists(path):
        if (args.resume or args.evaluate) and place.nproc == place.world_size:
            raise Fatal(f"no checkpoint at {path}")
        return
    if model is None:
        with torch.device("meta"):
            model = task.make_model(args)
    ckpt = load(path)
    if keep:
        READ[path] = stat(path), ckpt
    check_same_run(args, ckpt, path)
    if os.path.isdir(path):
        fits_sharded(model, path)
    else:
        load_model_state(model, ckpt["model"], path, assign=True)


def agreed(args, wish, place, device, log=print):
    """The checkpoint every process resumes from, or None, and the job's precision, decided by
    all together in one gather: each says what it asks for, which snapshot it sees (nodes may
    have disks of their own), its node, the run its flags define, and whether its device
    computes bfloat16. They resume if any asks to and any has a snapshot, all from the same one;
    a process that lacks it (a node that joins with an empty disk, or an older copy) is refused,
    every copy left as it was: no process runs other collectives than the rest."""
    path = args.checkpoint
    ckpt = None
    if wish and path and os.path.exists(path):
        then, read = READ.pop(path, (None, None))
        ckpt = read if then == stat(path) else load(path)  # once (check_file's), if unchanged
    run = zlib.crc32(repr(sorted(run_flags(args).items())).encode())  # the same flags, one number
    fast = machine.computes_bf16(device.index if device.type == "cuda" else None)[0] is True
    everyone = [(wish, *((ckpt["epoch"], ckpt.get("step", 0)) if ckpt else (-1, -1)),
                 place.node, run, fast)]
    if dist.is_initialized():
        everyone = common.gather(everyone[0], device)
    other = [str(r) for r, e in enumerate(everyone) if e[4] != everyone[0][4]]
    if other:
        raise Fatal(f"the processes of rank(s) {', '.join(other)} were started with other flags "
                    "than rank 0's; give every node the same command")
    wish, newest = max(e[0] for e in everyone), max(tuple(e[1:3]) for e in everyone)
    resume = wish == RESUME or (wish == RESUME_IF_FOUND and newest != (-1, -1))
    if resume and newest == (-1, -1):
        raise Fatal(f"no checkpoint at {path}" + " on any node" * (len(everyone) > 1))
    behind = [r for r, e in enumerate(everyone) if resume and tuple(e[1:3]) != newest]
    if behind:
        source = next(r for r, e in enumerate(everyone) if tuple(e[1:3]) == newest)
        nodes = sorted({everyone[r][3] for r in behind})
        raise Fatal(f"rank(s) {', '.join(map(str, behind))} (node(s) {', '.join(map(str, nodes))})"
                    f" lack the copy of {path} that rank {source} resumes from ({newest[0]} "
                    f"epoch(s) + {newest[1]} step(s)): copy it to that node, or use a shared "
                    "filesystem")
    ckpt = ckpt if resume else None
    lacking = [r for r, e in enumerate(everyone) if not e[5]]
    resumed = ckpt and ckpt.get("args", {}).get("amp", "none")  # the precision it trained in
    machine.settle_precision(args, place, device, lacking, resumed, log)
    return ckpt


def restore(ckpt, model, optimizer, scheduler, scaler, path, log=print):
    """A checkpoint (or None) loaded into freshly built objects: (epoch, step) to continue from.
    Nothing of it stays mapped: it is emptied, and the optimizer's CPU tensors are copies."""
    if not ckpt:
        return 0, 0
    if os.path.isdir(path):
        restore_sharded(model, optimizer, path)
    else:
        load_model_state(model, ckpt["model"], path)
        optimizer.load_state_dict(ckpt["optimizer"])  # its CPU tensors: the mapped file's,
        for s in optimizer.state.values():  # uncopied, which would keep it mapped all the run
            s.update({k: v.clone() for k, v in s.items() if torch.is_tensor(v) and v.is_cpu})
    scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler") and scaler.is_enabled():  # a checkpoint without fp16 has no scale
        scaler.load_state_dict(ckpt["scaler"])
    position = ckpt["epoch"], ckpt.get("step", 0)
    log(f"loaded {path}: {position[0]} epoch(s) + {position[1]} step(s) trained")
    ckpt.clear()
    return position


def load_model_state(model, state_dict, path, assign=False):
    """Strict load; a "module." prefix from an old DataParallel/DDP save is stripped first."""
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    if assign:  # torch notes assign in the dict's _metadata, where a later plain load of the
        metadata = getattr(state_dict, "_metadata", {})  # same dict finds it, and replaces the
        state_dict = OrderedDict(state_dict)  # parameters the optimizer holds: a copy for it
        state_dict._metadata = {k: dict(v) for k, v in metadata.items()}  # (pytorch#188166)
    try:
        model.load_state_dict(state_dict, assign=assign)
    except RuntimeError as e:
        detail = " ".join(ln.strip() for ln in str(e).splitlines()[1:3])
        raise Fatal(f"checkpoint {path} does not fit this model: {detail[:300]}") from None
