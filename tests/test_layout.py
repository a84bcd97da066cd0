"""The repository's shape (docs/maintainers.md#where-things-are): the scripts and common.py at
the top, the machinery in one package whose modules import only those below them, SIGTERM
handled in one module, a copy of one script, common.py and the package that trains inside a
project whose own packages have the names a copy would otherwise collide with; and the suite's
own machinery (its shared runs, the GPU lease's dry run)."""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, keep, read_metrics, repo_files, run_script, threads

PACKAGE = ROOT / "ddpkit"
SCRIPTS = {"spawn_ddp", "torchrun_ddp", "dp_baseline", "apex_ddp", "torchrun_fsdp"}
TOOLS = {"bench"}  # at the top too, as the card allows: it runs the scripts
SCRIPT_IMPORTS = {("apex_ddp", "torchrun_ddp")}  # the native path: docs/apex.md says why


def imports(path):
    """The repository's own modules that a file imports: "common", a script's name, or
    "ddpkit.NAME" (absolute or relative, `from ddpkit import a, b` naming each)."""
    ours = {p.stem for p in ROOT.glob("*.py")} | {"ddpkit"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "ddpkit" if node.level else node.module
            if node.level and node.module:
                base = f"ddpkit.{node.module}"
            names = [f"{base}.{a.name}" if base == "ddpkit" else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in ours}
    return found


def order():
    """The package's modules, lowest first, as its docstring states them."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    [line] = re.findall(r"Order: ([\w, ]+)\.", " ".join(doc.split()))
    return [name.strip() for name in line.split(",")]


def test_the_top_level_holds_the_scripts_and_common_only():
    tops = {p.stem for p in ROOT.glob("*.py")}
    assert tops == SCRIPTS | TOOLS | {"common"}, sorted(tops)
    assert (PACKAGE / "__init__.py").exists()  # a regular package: one thing to every tool


def test_the_docstring_orders_every_module_of_the_package():
    assert sorted(order()) == sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_no_import_runs_back_up():
    """A module of the package imports common.py and the modules before it in the order, never
    one after it, and never a script; common.py imports nothing of the repository; a script
    imports no other script but the one pair docs/apex.md explains."""
    names = order()
    for i, name in enumerate(names):
        allowed = {"common"} | {f"ddpkit.{n}" for n in names[:i]}
        assert imports(PACKAGE / f"{name}.py") <= allowed, \
            f"ddpkit/{name}.py imports {sorted(imports(PACKAGE / f'{name}.py') - allowed)}"
    assert imports(ROOT / "common.py") == set()
    for script in SCRIPTS | TOOLS:
        others = {n for n in imports(ROOT / f"{script}.py") if n in SCRIPTS | TOOLS}
        assert {(script, o) for o in others} <= SCRIPT_IMPORTS, (script, others)


def test_the_checker_sees_an_arrow_back_up(tmp_path):
    """imports() reads every form of import the package could use to point upwards."""
    f = tmp_path / "m.py"
    f.write_text("import spawn_ddp\nfrom . import flags\nfrom .launch import Place\n"
                 "from ddpkit import data\nimport ddpkit.task\nimport os\n")
    assert imports(f) == {"spawn_ddp", "ddpkit.flags", "ddpkit.launch", "ddpkit.data",
                          "ddpkit.task"}


def test_one_module_handles_sigterm():
    """signal.signal, a signal mask and a wait for a signal appear in ddpkit/sigterm.py alone,
    of every Python file of the repository but its tests."""
    calls = re.compile(r"signal\.(signal|pthread_sigmask|sigwait\w*)\(")
    files = [p for p in repo_files("*.py") if "tests" not in p.relative_to(ROOT).parts]
    handling = sorted(str(p.relative_to(ROOT)) for p in files if calls.search(p.read_text()))
    assert handling == ["ddpkit/sigterm.py"]


USER_PACKAGES = ("data", "utils", "models", "config", "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ddp.py", "spawn_ddp.py"])
def test_a_copy_trains_in_a_project_with_packages_of_common_names(tiny_mnist, tmp_path, script):
    """What a user does: one script, common.py and ddpkit/ copied into a project that has its
    own data/, utils/, models/, config/ and checkpoint/ packages. Each of those fails if it is
    imported, so that a module of ours that a package of the project stands in for fails the
    run (a module named data.py at the top did: Python prefers the package)."""
    project = tmp_path / "project"
    for name in USER_PACKAGES:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(
            f"raise ImportError('the project\\'s own {name}/ was imported')\n")
    shutil.copy(ROOT / script, project)
    shutil.copy(ROOT / "common.py", project)
    shutil.copytree(PACKAGE, project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2") \
        if script.startswith("torchrun") else ()
    run_script(script, "--data-dir", tiny_mnist, "--batch-size", 64, "--metrics",
               project / "m.jsonl", repo=project, cwd=project, launcher=launcher,
               **threads(script))
    [row] = read_metrics(project / "m.jsonl")
    assert row["world_size"] == 2 and row["total"] > 0


def test_the_gpu_lease_dry_run_lists_its_work(tmp_path):
    """tests/gpu_lease.sh on a machine without a GPU: exit 0, naming the cuda tests one GPU
    would run (the one-GPU and two-GPU halves) and every case of tests/nccl_probe.py on both
    NCCL engines, and starting none of them (a lease is too scarce to find a typo in)."""
    (tmp_path / "bin").mkdir()
    python3 = tmp_path / "bin" / "python3"  # the suite's interpreter, its venv kept: a link
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # outside a venv is
    python3.chmod(0o755)  # the base interpreter, without the venv's packages
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    r = subprocess.run(["bash", "tests/gpu_lease.sh"], cwd=ROOT, text=True, capture_output=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PATH": path,
                                         "OUT": str(tmp_path / "out")})
    assert r.returncode == 0 and r.stdout.startswith("no GPU here: a dry run"), r.stdout + r.stderr
    for name in ("test_cuda.py::test_deterministic_runs_are_bit_identical_on_a_gpu",
                 "test_cuda.py::test_no_process_but_rank_r_uses_gpu_r[spawn_ddp.py]",
                 *(f"[{e}] {c}: " for e in ("default", "legacy")
                   for c in ("before", "after", "cost", "leave", "recorder"))):
        assert name in r.stdout, (name, r.stdout)
    assert not list((tmp_path / "out").iterdir())  # no log: nothing ran


def test_a_shared_run_that_fails_runs_once_and_shows_its_cause(shared):
    """conftest.shared, the suite's own machinery: a run that fails (here a launch whose script
    raised a TypeError, then the file it never wrote) is made once, and every test that asks
    for it fails with that error and the end of its launch's stderr, not only the missing file
    (a broken stop path once failed 16 tests each with FileNotFoundError, each rerunning it)."""
    made = []

    def make(d):
        made.append(d)
        keep(d, "run", subprocess.CompletedProcess([], 1, "", "Traceback (most recent call "
                                                   "last):\nTypeError: stop() takes 1 argument"))
        (d / "c.pt").read_bytes()
    for _ in range(2):
        with pytest.raises(pytest.fail.Exception) as failed:
            shared("fails-on-purpose", make)
        said = str(failed.value)
        assert "FileNotFoundError" in said and "TypeError: stop() takes 1 argument" in said, said
    assert len(made) == 1
