"""Runs one script's real main() once per command line, all in this one process, and reports how
each ended. tests/test_bad_input.py feeds it a table of cases: one start-up of torch for the
whole table instead of one per case (each start-up takes 5-15 s on a 2-core machine).

    python tests/run_mains.py SCRIPT < cases.jsonl > results.jsonl

A case is {"argv": [...], "env": {...}}. A result adds "code" (the exit code; 0 when main
returned), "stdout", "stderr", and "started": True when the run got as far as starting work,
i.e. reading the training data, spawning workers or starting a subprocess. That point is
where the hooks below stop it: the checks under test all come before it.

With "mode": "parse", a case stops as soon as its command line has been parsed ("started" then
means: it parsed); with "mode": "describe", the result also lists the parser's flags
("flags": [[option strings], default, takes a value]).
"""
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback

script = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(script))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from ddpkit import flags, launch, task  # noqa: E402


class Started(BaseException):
    """Not an Exception: the scripts' clean_exit must not turn it into an error line."""


def started(*args, **kwargs):
    raise Started


mode = {}
# bench.py parses its own flags with parse_known_args (the rest go to the scripts); the scripts
# with parse_args, which refuses a flag it does not know
METHOD = "parse_known_args" if os.path.basename(script) == "bench.py" else "parse_args"
_parse = getattr(flags.Parser, METHOD)


def parse(self, *args, **kwargs):
    """The program's parser; in the parse and describe modes the case ends here."""
    parsed = _parse(self, *args, **kwargs)
    if mode.get("describe"):
        mode["flags"] = [[a.option_strings, a.default, a.nargs != 0] for a in self._actions
                         if a.option_strings and a.dest != "help"]
    if mode.get("parse") or mode.get("describe"):
        raise Started
    return parsed


setattr(flags.Parser, METHOD, parse)
launch.end = sys.exit              # the scripts' end, os._exit's, would end this process too
mp.spawn = started                # spawn_ddp.py starts its workers
subprocess.run = started          # bench.py runs the scripts
subprocess.Popen = started
_load_task = task.load_task


def load_task(name):
    """The task, whose datasets start work: every training script builds them before its first
    step (common.py's own names stay, so MNIST's prepare_data still checks the files)."""
    loaded = _load_task(name)
    loaded.make_datasets = started
    return loaded


task.load_task = load_task

for line in sys.stdin:
    case = json.loads(line)
    env = dict(os.environ)
    os.environ.update(case.get("env", {}))
    blocked = case.get("env", {}).get("DDP_TEST_BLOCK")  # as sitecustomize blocks it at a start
    if blocked:
        unblocked = sys.modules.get(blocked)
        sys.modules[blocked] = None  # `import NAME` raises ImportError
    sys.argv = [script, *case["argv"]]
    out, err = io.StringIO(), io.StringIO()
    result = {"argv": case["argv"], "code": 0, "started": False}
    mode.clear()
    mode[case.get("mode", "run")] = True
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except Started:
            result["started"] = True
        except SystemExit as e:
            result["code"] = e.code if isinstance(e.code, int) else 1
        except BaseException:  # a traceback is what the table exists to catch
            traceback.print_exc()
            result["code"] = "traceback"
    if blocked:
        sys.modules.pop(blocked) if unblocked is None else sys.modules.update({blocked: unblocked})
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    result.update(stdout=out.getvalue(), stderr=err.getvalue(), flags=mode.get("flags"))
    print(json.dumps(result), flush=True)
