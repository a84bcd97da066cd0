"""The README and docs/ stay true without a person re-auditing them: the flags docs/flags.md
names are the parsers' (those only some scripts take, all there), every test name, file
and link they cite exists, the README's links into the scripts point at the lines they name,
and every command in their code blocks parses with the real parser of the program it runs.
The scripts' parsers are read through tests/run_mains.py (describe and parse modes), so a
command is checked without running anything."""
import difflib
import functools
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, run_mains

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = ("dp_baseline.py", "spawn_ddp.py", "torchrun_ddp.py", "apex_ddp.py", "torchrun_fsdp.py")
SBATCH = {"slurm/torchrun_ddp.sbatch": "torchrun_ddp.py", "slurm/spawn_ddp.sbatch": "spawn_ddp.py"}


def readme():
    return (ROOT / "README.md").read_text()


def test_the_flags_page_names_what_the_parsers_have():
    """docs/flags.md points to --help instead of repeating it; what it does say stays true:
    every flag that some scripts take and others do not is on the page, and every flag the
    page names is a flag of some script (or of bench.py)."""
    text = (ROOT / "docs" / "flags.md").read_text()
    named = set(re.findall(r"`(--[\w-]+)", text))
    takes = {}
    for script in (*SCRIPTS, "bench.py"):
        [r] = run_mains(script, [{"argv": [], "mode": "describe"}])
        takes[script] = {flag for options, _, _ in r["flags"] for flag in options}
    every = set.union(*takes.values())
    some = set.union(*(takes[s] for s in SCRIPTS)) - set.intersection(*(takes[s] for s in SCRIPTS))
    assert some and some <= named, f"docs/flags.md leaves out {sorted(some - named)}"
    assert named <= every | {"--help"}, f"no script has {sorted(named - every)}"


def lesson_section():
    return readme().split("## From one process to DDP", 1)[1].split("\n## ", 1)[0]


def test_readme_links_point_at_the_ddp_lines():
    """The lesson's table (rows numbered as the block's steps) links each change to its line in
    lesson/ddp.py; the full scripts' table, to its lines in spawn_ddp.py and torchrun_ddp.py.
    Each row names the code (its first backticked text) that the lines it links to contain."""
    rows = [line for line in lesson_section().splitlines() if re.search(r"\.py#L\d+", line)]
    lesson = [row for row in rows if re.match(r"\| (\d+|\+) \|", row)]
    assert len(lesson) >= 11 and len(rows) - len(lesson) >= 10
    for row in rows:
        code = re.search(r"`([^`]+)`", row).group(1)
        links = re.findall(r"\]\(([\w./]+\.py)#L(\d+)\)", row)
        files = {"lesson/ddp.py"} if row in lesson else {"spawn_ddp.py", "torchrun_ddp.py"}
        assert {f for f, _ in links} == files, row
        for shown, line in re.findall(r"\[(\d+)\]\([\w./]+\.py#L(\d+)\)", row):
            assert shown == line, f"README shows line {shown} but links to line {line}: {row}"
        for name, line in links:
            text = (ROOT / name).read_text().splitlines()[int(line) - 1]
            assert code in text, f"README: {name}#L{line} is {text.strip()!r}, not {code!r}"


def test_the_fsdp_table_links_its_lines():
    """The FSDP2 chapter's table: at least the seven changes, each linked to its line in
    lesson/fsdp.py, whose code (the row's first backticked text) that line contains."""
    section = readme().split("## From DDP to FSDP2", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 7
    lines = (ROOT / "lesson" / "fsdp.py").read_text().splitlines()
    for row in rows:
        code = re.search(r"`([^`]+)`", row).group(1)
        [(shown, line)] = re.findall(r"\[(\d+)\]\(lesson/fsdp\.py#L(\d+)\)", row)
        assert shown == line and code in lines[int(line) - 1], row
        assert all(len(cell.split()) <= 32 for cell in row.strip("|").split("|")), row


def test_the_lesson_tables_have_short_cells():
    """No cell of the lesson's two tables is longer than about 30 words."""
    for line in lesson_section().splitlines():
        if line.startswith("|"):
            for cell in line.strip("|").split("|"):
                assert len(cell.split()) <= 32, cell


def test_the_readme_block_is_the_lessons_code():
    """Every line of code in the README's numbered block stands in lesson/ddp.py as it is
    (whitespace aside; "..." leaves out arguments), so that the block and the lesson stay in
    step; and the block shows every collective the lesson runs."""
    block = lesson_section().split("```python\n", 1)[1].split("```", 1)[0]
    code = [line.split("  #")[0].strip() for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    lesson = " ".join(re.sub(r"\s+#.*", "", line).strip()
                      for line in (ROOT / "lesson" / "ddp.py").read_text().splitlines())
    lesson = re.sub(r"([(\[{]) ", r"\1", lesson)  # a call broken over two lines, joined
    for line in code:
        parts = [re.escape(part).replace(re.escape(" "), r"\s*") for part in line.split("...")]
        assert re.search(".*?".join(parts), lesson), line
    collectives = re.findall(r"dist\.(all_reduce|broadcast|barrier)\(", lesson)
    assert sorted(set(collectives)) == ["all_reduce", "barrier", "broadcast"]
    for name in ("all_reduce(totals)", "all_reduce(counts)", "broadcast(buffer", "barrier()"):
        assert name in block, name


def changed_lines(a, b):
    one, two = ((ROOT / f).read_text().splitlines() for f in (a, b))
    return sum(1 for line in difflib.unified_diff(one, two, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_the_lesson_is_a_diff_of_at_most_60_lines():
    """The README's lesson is `diff lesson/one_process.py lesson/ddp.py`: a plain training loop
    and its DDP version, at most 60 changed lines (both sides), as many as the README says; and
    the full scripts keep the same shape: `diff dp_baseline.py spawn_ddp.py` at most 60 too, and
    so does the next chapter, `diff lesson/ddp.py lesson/fsdp.py`."""
    text = " ".join(readme().split())
    changed = changed_lines("lesson/one_process.py", "lesson/ddp.py")
    said = re.search(r"`diff lesson/one_process\.py lesson/ddp\.py` is the whole lesson, (\d+) "
                     r"changed lines", text)
    assert changed <= 60 and said and int(said.group(1)) == changed
    lines = len((ROOT / "lesson" / "one_process.py").read_text().splitlines())
    assert f"a plain training loop in one process ({lines} lines)" in text
    changed = changed_lines("dp_baseline.py", "spawn_ddp.py")
    said = re.search(r"`diff dp_baseline\.py spawn_ddp\.py` shows the lesson again between the "
                     r"full scripts, (\d+) changed lines", text)
    assert changed <= 60 and said and int(said.group(1)) == changed
    changed = changed_lines("lesson/ddp.py", "lesson/fsdp.py")  # the next chapter
    said = re.search(r"`diff lesson/ddp\.py lesson/fsdp\.py` is that step, (\d+) changed", text)
    assert changed <= 60 and said and int(said.group(1)) == changed


def test_common_is_the_task_and_the_helpers_in_at_most_300_lines():
    """common.py as the design card has it: the task first, then the helpers the lesson uses;
    the machinery lives in modules of its own, which common.py does not import."""
    text = (ROOT / "common.py").read_text()
    assert len(text.splitlines()) <= 300
    assert text.index("# ---- 1. The task") < text.index("# ---- 2. The helpers")
    machinery = "checkpoint|data|flags|launch|machine|reporting"
    assert not re.search(rf"^import ({machinery})$|^from ({machinery}) ", text, re.M)


def test_readme_is_a_first_page():
    """At most 300 lines, and the Python block of the DDP changes on its first screen."""
    lines = readme().splitlines()
    assert len(lines) <= 300
    assert lines.index("```python") < 40


def test_every_cited_test_exists():
    defined = set()
    for f in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    for page in PAGES:
        for name in set(re.findall(r"`(test_\w+)`", page.read_text())) - {"test_acc"}:  # a metric
            assert name in defined, f"{page.name} cites {name}, which no test file defines"


def github_anchor(heading):
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_cited_path_and_link_exists():
    for page in PAGES:
        text = page.read_text()
        anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            if target.startswith("#"):
                assert target[1:] in anchors, f"{page.name}: no heading for the link {target}"
            else:
                path, _, anchor = target.partition("#")
                assert (page.parent / path).exists(), f"{page.name}: link to missing {path}"
                if path.endswith(".py"):  # a whole file, or a line (the README's DDP tables)
                    assert not anchor or re.fullmatch(r"L\d+", anchor), f"{page.name}: {target}"
                elif anchor:
                    theirs = (page.parent / path).read_text()
                    assert anchor in {github_anchor(h) for h in re.findall(r"^#+ (.+)$", theirs, re.M)}, \
                        f"{page.name}: no heading for the link {target}"
        for path in re.findall(r"`((?:tests|docs|slurm|\.ci|ddpkit)/[\w./-]*|[\w-]+\.(?:py|md|sbatch|txt))`", text):
            if path in {"main.py"}:  # other projects' file names, quoted
                continue
            assert (ROOT / path).exists(), f"{page.name} cites {path}, which does not exist"


def test_no_figure_left_to_fill_in():
    for page in PAGES:
        assert "{{" not in page.read_text(), f"{page.name} has a placeholder left"


def commands(text):
    """The commands of every ```bash block: continuation lines joined, comments dropped,
    leading VAR=value assignments removed."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if words:
                yield words


def pytest_generate_tests(metafunc):
    if "command" in metafunc.fixturenames:
        cmds = [(page.name, words) for page in PAGES for words in commands(page.read_text())]
        metafunc.parametrize("command", cmds, ids=[f"{p}: {' '.join(w)[:70]}" for p, w in cmds])


def markers():
    ini = (ROOT / "pytest.ini").read_text()
    return set(re.findall(r"^\s+(\w+):", ini, re.M))


def test_readme_command_parses(command):
    """Each command runs the program it names with arguments that program accepts."""
    page, words = command
    prog = words[0]
    if prog in ("cd", "git", "export"):
        return
    if prog == "pip":
        if "-r" in words:
            assert (ROOT / words[words.index("-r") + 1]).exists()
        return
    if prog == "tensorboard":  # its viewer, of a --tensorboard folder
        assert words[1] == "--logdir" and len(words) == 3, words
        return
    if prog == "sbatch":
        assert words[1] in SBATCH, words
        return check_script_args(SBATCH[words[1]], words[2:])
    if prog == "torchrun":
        return check_launcher("torch.distributed.run", words[1:])
    assert prog == "python", f"{page}: a command the README test does not know: {words}"
    if words[1] == "-c":
        compile(words[2], "<readme>", "exec")
    elif words[1:3] == ["-m", "venv"]:  # a virtual environment, then its activation
        assert words[3:] == [".venv", "&&", ".", ".venv/bin/activate"], words
        assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()
    elif words[1:3] == ["-m", "pytest"]:
        if "-m" in words[3:]:
            expr = words[words.index("-m", 3) + 1]
            for name in re.findall(r"\w+", expr):
                assert name in markers() | {"not", "and", "or"}, f"unknown marker {name}"
        for path in words[3:]:
            if path.startswith("tests/"):
                assert (ROOT / path.split("::")[0]).exists(), path
    elif words[1:3] == ["-m", "torch.distributed.launch"]:
        check_launcher("torch.distributed.launch", words[3:])
    elif words[1:3] == ["-m", "torch.distributed.checkpoint.format_utils"]:  # torch's converter
        usage = subprocess.run([sys.executable, *words[1:3], "--help"], capture_output=True,
                               text=True, check=True).stdout
        assert words[3] in usage and len(words) == 6, words  # a mode, the folder, the file
    else:
        check_script_args(words[1], words[2:])


def check_launcher(module, words):
    """torchrun's (or the old launcher's) own flags with its own parser, then the script's."""
    import importlib
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    try:
        importlib.import_module(module).parse_args([*words[:at], "x.py"])
    except SystemExit as e:
        pytest.fail(f"{module} refuses {words[:at]} ({e})")
    check_script_args(words[at], words[at + 1:])


@functools.cache
def parsed():
    """Every script command of every page parsed at once, one torch start-up per script:
    {(script, args): result}."""
    wanted = {}
    for page in PAGES:
        for words in commands(page.read_text()):
            at = next((i for i, w in enumerate(words) if w.endswith((".py", ".sbatch"))), None)
            if at is not None:
                script = SBATCH.get(words[at], words[at])
                wanted.setdefault(script, set()).add(tuple(words[at + 1:]))
    results = {}
    for script, argvs in wanted.items():
        if script in (*SCRIPTS, "bench.py"):
            argvs = sorted(argvs)
            for args, r in zip(argvs, run_mains(script, [{"argv": list(a), "mode": "parse"}
                                                           for a in argvs])):
                results[script, args] = r
    return results


@functools.cache
def lesson_help(script):
    return subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                          text=True, check=True).stdout


def check_script_args(script, args):
    if script.startswith("lesson/"):  # argparse alone: each flag is one its --help lists
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert re.search(rf"^\s+{flag}\b", lesson_help(script), re.M), (script, flag)
        return
    assert script in (*SCRIPTS, "bench.py"), script
    r = parsed()[script, tuple(args)]
    if "--help" in args or "-h" in args:  # argparse prints the help and exits 0 before main runs
        assert r["code"] == 0 and "usage:" in r["stdout"] and not r["stderr"], f"{script} {' '.join(args)}: {r['stderr']}"
        return
    assert r["started"] and r["code"] == 0, f"{script} {' '.join(args)}: {r['stderr']}"


def test_the_cuda_tests_needing_two_gpus_are_listed():
    """docs/maintainers.md names the `cuda` tests that skip on one GPU, and those that run at
    1 GPU and again at 2, as tests/test_cuda.py marks them (two_gpus)."""
    src = (ROOT / "tests" / "test_cuda.py").read_text()
    decorated = re.findall(r"((?:^@.*\n(?:^ .*\n)*)+)def (test_\w+)", src, re.M)
    two = {name for above, name in decorated if "@two_gpus" in above}
    both = {name for above, name in decorated if "marks=two_gpus" in above}
    doc = (ROOT / "docs" / "maintainers.md").read_text()
    listed = {kind: set(re.findall(r"`(test_\w+)`", doc[doc.index(f"- **{kind}"):].split(
        "\n- ")[0].split("\n\n")[0])) for kind in ("At 1 GPU, and again at 2", "Two GPUs only")}
    assert (listed["At 1 GPU, and again at 2"], listed["Two GPUs only"]) == (both, two)
    assert len(two) >= 10 and len(both) >= 5  # (the patterns still find them)
