"""The task: the names the scripts call it by (SEAM), loaded from --task or common.py
(`load_task`), and how an error in its code is said (`failure`): with the task's own frames,
as a misfit (bad input) until its first loss. docs/your-own-task.md."""
import functools
import importlib
import os
import sys
import traceback
import types
import warnings

import torch

import common
from common import Fatal

SEAM = ("add_task_flags", "prepare_data", "make_datasets", "collate", "make_model", "loss_fn",
        "make_optimizer", "make_scheduler", "evaluate_batch", "summarize",
        "fsdp_units")  # docs/your-own-task.md
TASK_CODE = {}  # the loaded task's functions' code: how an error in them is said (`failure`)
CHECKING = [True]  # until loss_fn's first call returns: a failure in the task is a misfit


def load_task(name):
    """The task the scripts train, as one namespace of the names in SEAM: those of --task (a
    Python file, or an importable module) where it defines them, common.py's where it does not,
    and all of common.py's without --task. common.py's own names are never rebound. A task that
    makes its own datasets prepares none of MNIST's. A file is imported under its own name with
    its folder on the path, so that processes started by spawn import it by that name too. (A
    checkpoint names its task only to be compared: no code is ever imported because a file says
    so, docs/security.md.) The first call of loss_fn is checked (`first_call_checked`)."""
    module = common
    if name and (name.endswith(".py") or os.sep in name or "/" in name):
        if not os.path.isfile(name):
            raise Fatal(f"--task {name}: no such file")
        folder, module = os.path.split(os.path.abspath(name)[:-len(".py")])
        if folder not in sys.path:
            sys.path.insert(0, folder)
    elif name:
        module = name
    if module is not common:
        try:
            module = importlib.import_module(module)
        except Exception as e:  # bad input: said where it is in the task, without our frames
            raise Fatal(f"--task {name}: {import_error(e, module)}") from None
    task = types.SimpleNamespace(**{n: getattr(module, n, getattr(common, n)) for n in SEAM})
    if module is not common and hasattr(module, "make_datasets") \
            and not hasattr(module, "prepare_data"):
        task.prepare_data = lambda args: None  # common.py's prepares MNIST
    TASK_CODE.clear()
    CHECKING[:] = [True]
    TASK_CODE.update({f.__code__: n for n, f in vars(task).items() if hasattr(f, "__code__")})
    task.loss_fn = first_call_checked(task.loss_fn)
    TASK_CODE[task.loss_fn.__code__] = "loss_fn"
    task.make_optimizer = unused_checked(task.make_optimizer)
    TASK_CODE[task.make_optimizer.__code__] = "make_optimizer"
    return task


def import_error(e, module):
    """Why the task `module` did not import: "no module named ..." where it is not there, else
    the error, then where it is, as Python shows it: a syntax error's line and caret, or the
    frames of the task's own files (not importlib's, not ours)."""
    if isinstance(e, ModuleNotFoundError) and e.name and (
            module == e.name or module.startswith(e.name + ".")):
        return f"no module named {e.name}"
    if isinstance(e, SyntaxError):  # its line, and the caret under it
        *where, what = traceback.format_exception_only(e)
        return f"{what.strip()}\n" + "".join(where).rstrip()
    ours = (os.path.dirname(importlib.__file__), "<frozen", __file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
    return f"{common.reason(e)}\n" + "".join(traceback.format_list(frames)).rstrip()


def first_call_checked(loss_fn):
    """loss_fn, whose first call in a process (the first training step) raises the warnings of
    its own arithmetic as errors, and refuses a loss that is not one number: a loss whose output
    and target only broadcast to each other warns, and would train on nonsense. Only loss_fn's:
    a model's forward may warn of nothing wrong (a library's notices)."""
    @functools.wraps(loss_fn)
    def checked(output, target):
        if not CHECKING:
            return loss_fn(output, target)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                loss = loss_fn(output, target)
            if torch.as_tensor(loss).numel() != 1:
                raise ValueError(f"it returned a tensor of shape {list(loss.shape)}, not one "
                                 "number")
        except Exception as e:
            if torch.is_tensor(output) and torch.is_tensor(target) \
                    and output.shape != target.shape:
                try:
                    torch.broadcast_shapes(output.shape, target.shape)
                    e.task_note = f"output {list(output.shape)} and target " \
                                  f"{list(target.shape)} only broadcast to each other; "
                except RuntimeError:
                    pass
            raise
        CHECKING.clear()
        return loss
    return checked


def same_weights(model, device):
    """FSDP sends no initial weights: a make_model that differs between processes (a seed or a
    file of its own) would train a patchwork. One all-gather of two numbers (the sum and the sum
    of squares of every weight) finds it, and names the processes, before anything trains."""
    tensors = [t for t in model.state_dict().values() if t.is_floating_point() and not t.is_meta]
    everyone = common.gather([sum(t.sum(dtype=torch.float64).item() for t in tensors), sum(
        torch.linalg.vector_norm(t, dtype=torch.float64).item() ** 2 for t in tensors)], device)
    other = [str(r) for r, e in enumerate(everyone) if e != everyone[0]]
    if other:
        raise Fatal(f"make_model built other weights in rank(s) {', '.join(other)} than in rank "
                    "0 (a seed or a file of its own per process?): FSDP sends none, so every "
                    "process must build the same (docs/fsdp.md)")


def unused_checked(make_optimizer):
    """make_optimizer, whose optimizer checks its first step under DDP without
    --find-unused-parameters: DDP cannot finish a step whose backward leaves a parameter without
    a gradient, and says so at the next forward, in a paragraph that names none. The check names
    them in one line, before anything is updated."""
    @functools.wraps(make_optimizer)
    def made(model, args):
        optimizer = make_optimizer(model, args)

        def check(*_):
            handle.remove()
            unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            if unused:
                raise Fatal(f"the model's {', '.join(unused[:4])}{' ...' * (len(unused) > 4)} got "
                            "no gradient in the first step (a branch its forward skips): add "
                            "--find-unused-parameters, or freeze them (requires_grad=False)")
        if getattr(args, "find_unused_parameters", True) is False:  # the DDP scripts' flag
            handle = optimizer.register_step_pre_hook(check)
        return optimizer
    return made


def failure(e):
    """(`error:`'s line and the frames under it, the exit code) for an exception. One raised in
    the task's code (a function of the task, the model's forward, the dataset): its line and the
    frames of the task's files alone; up to the first loss (`CHECKING`) the line says "the task
    does not fit the scripts" (`misfit`), and the code is 2, bad input. Any other: its
    line, its frames but the first (main's), and code 1."""
    walked = list(traceback.walk_tb(e.__traceback__))
    codes = [frame.f_code for frame, _ in walked]
    files = {code.co_filename for code in TASK_CODE} - {failure.__code__.co_filename}  # less ours
    helpers = {common.forward.__code__, common.to_device.__code__, common.evaluate.__code__}
    part = next((f"{TASK_CODE[c]}({', '.join(c.co_varnames[:c.co_argcount])})"
                 for c in codes if c in TASK_CODE), None)
    if part is None and common.forward.__code__ in codes:
        part = "the model's forward"
    elif part is None and any(c.co_filename.endswith(os.path.join("_utils", "fetch.py"))
                              for c in codes):  # the DataLoader's fetch, in this process
        part = "the dataset"
    if part is None:
        return f"{common.reason(e)}\n" + "".join(traceback.format_list(
            traceback.extract_tb(e.__traceback__)[1:])).rstrip(), 1
    kept = [(f, n) for f, n in walked if f.f_code.co_filename in files
            and f.f_code not in helpers]
    line = misfit(e, part, codes) if CHECKING else common.reason(e)
    frames = "".join(traceback.StackSummary.extract(kept).format()).rstrip()
    return f"{line}\n{frames}".rstrip(), 2 if CHECKING else 1


def misfit(e, part, codes):
    """The line of a task that does not fit: where it failed, our diagnosis, then the error's
    words, cut: about 200 characters where we diagnosed it, else up to 260 with "[rank N]
    error: " (the error's words are the diagnosis)."""
    step = common.evaluate.__code__ not in codes and part.startswith(
        ("loss_fn", "collate", "the model's forward", "the dataset"))  # (make_optimizer's: no)
    forward, note = part == "the model's forward", getattr(e, "task_note", "")
    said = "the task does not fit the scripts" + " in the first training step" * step + (
        " (train mode; the evaluation-mode check passed)" * (step and forward)) + f": {note}"
    words, doc = f"{part} raised {common.reason(e)}", " (docs/your-own-task.md)"
    room = max((200 if note else 243) - len(said) - len(doc), 40)
    return said + (words if len(words) <= room else words[:room - 3] + "...") + doc

