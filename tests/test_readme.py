"""The README stays honest: a user's manual of at most 350 lines whose first screens' commands and
code are run by the suite or by CI, whose table figures each name the command that reproduces them
(a command that parses, with options that exist), and whose links, like the docs', resolve. Every
page of docs/ starts with what a user does, and no tracked file speaks of work sessions or issue
numbers: the history of the code is in `git log`. Cheap: no process is started but `git ls-files`."""
import argparse
import ast
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 350
FIRST_SCREENS_END = "## How it works"  # the heading where the README's first screens end

# Every command of the first screens -> the test that runs it: (test file, test function, strings its
# source must hold, showing it runs that command). Commands that only CI runs are checked against .ci/run.
RUN_BY = {
    "hotswitch demo": ("tests/test_cli.py", "test_demo_end_to_end", ['"hotswitch.cli"', '"demo"']),
    "torchrun --nproc-per-node 4 examples/switch_hf_model.py": (
        "tests/test_examples.py", "test_switch_hf_model_under_torchrun_follows_one_device",
        ['"torch.distributed.run"', '"examples/switch_hf_model.py"']),
}
# The README's Python blocks: the first is checked to be the example's code (which that module runs),
# the second (models larger than one device) is run as it stands.
PYTHON_BLOCK_TESTS = (("tests/test_examples.py", "test_readme_python_is_the_examples_code"),
                      ("tests/test_big_models_world4.py", "check_readme_big_model_lines"))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def _first_screens() -> str:
    text = _text(README)
    assert FIRST_SCREENS_END in text, f"README.md lost its {FIRST_SCREENS_END!r} heading (update FIRST_SCREENS_END)"
    return text[:text.index(FIRST_SCREENS_END)]


def _commands(line: str) -> list[list[str]]:
    """The commands of a shell line (comments dropped, split at &&), each as its words."""
    words = shlex.split(line, comments=True)
    out, current = [], []
    for w in words:
        if w == "&&":
            out.append(current)
            current = []
        else:
            current.append(w)
    return [c for c in out + [current] if c]


def _function_source(test_file: str, name: str) -> str:
    source = _text(ROOT / test_file)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"{test_file} has no function {name}: the README's command lost its test")


def _ci_lines() -> list[str]:
    return [line.split("#")[0].strip() for line in _text(ROOT / ".ci" / "run").splitlines()]


def _torch_pin() -> str:
    pins = re.findall(r'"(torch==[^"]+)"', _text(ROOT / "pyproject.toml"))
    assert len(pins) == 1, pins
    return pins[0]


# ------------------------------------------------------------------------------------------ the CLI
def _parser() -> argparse.ArgumentParser:
    from hotswitch.cli import build_parser

    return build_parser()


def _subcommand(words: list[str]) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """For `hotswitch a b --x ...`: the parser of `a b`, the sub-command path, the remaining words."""
    parser, path = _parser(), []
    words = list(words)
    while words:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or words[0] not in actions[0].choices:
            break
        path.append(words[0])
        parser = actions[0].choices[words.pop(0)]
    return parser, path, words


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _check_hotswitch(words: list[str], mentioned=(), runnable: bool = True) -> None:
    """`words` after `hotswitch`: a known command; with `runnable`, its arguments parse as given;
    every option in `mentioned` is one of that command's."""
    parser, path, rest = _subcommand(words)
    assert path, f"'hotswitch {' '.join(words)}': no such command"
    if runnable:
        try:
            _parser().parse_args(words)
        except SystemExit as e:
            raise AssertionError(f"'hotswitch {' '.join(words)}' does not parse") from e
    unknown = {o for o in mentioned if o not in _options(parser)}
    assert not unknown, f"'hotswitch {' '.join(path)}' has no option {sorted(unknown)}"


def _check_command(command: str, mentioned=()) -> None:
    """A command a table names: `hotswitch ...`, `python benchmarks/X.py ...` or `[VAR=value ...]
    python -m pytest ...`, checked against the code it runs."""
    words = shlex.split(command)
    env = []
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        env.append(words.pop(0).split("=")[0])
    options = {w.split("=")[0] for w in words if w.startswith("--")} | set(mentioned)
    if words[0] == "hotswitch":
        _check_hotswitch(words[1:], options)
    elif words[:2] == ["python", "-m"] and words[2] == "pytest":
        markers = [words[i + 1] for i, w in enumerate(words) if w == "-m" and i > 1]
        declared = _text(ROOT / "pyproject.toml")
        for marker in markers:
            for name in re.findall(r"[a-z]+", marker):
                assert name in {"not", "and", "or"} or f'"{name}:' in declared, f"no pytest marker {name!r}"
    elif words[0] == "python" and words[1].endswith(".py"):
        script = ROOT / words[1]
        assert script.is_file(), f"{words[1]} does not exist"
        source = _text(script)
        missing = {o for o in options if f'"{o}"' not in source}
        assert not missing, f"{words[1]} takes no option {sorted(missing)}"
    else:
        raise AssertionError(f"{command!r}: not a command this test knows how to check")
    for var in env:
        assert any(var in _text(p) for p in (ROOT / "tests").glob("*.py")) or any(
            var in _text(p) for p in ROOT.glob("hotswitch/**/*.py")), f"nothing reads {var}"


# ------------------------------------------------------------------------------------------ tables
def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(the heading above it, header cells, body rows) of every Markdown table outside code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    tables, heading, rows = [], "", []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if rows:
            tables.append((heading, rows[0], [r for r in rows[2:]]))
            rows = []
        if line.startswith("#"):
            heading = line
    return tables


def _spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _is_command(span: str) -> bool:
    return bool(re.match(r"([A-Z_]+=\S* )*(hotswitch|python|torchrun) ", span + " "))


# ------------------------------------------------------------------------------------------ tests
def test_readme_is_a_short_manual():
    lines = _text(README).splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES} (move detail to docs/)"
    first = "\n".join(lines[:40])
    for command in ("pip install torch==2.13.0 -e . && hotswitch demo",
                    "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q tests"):
        assert command in first, f"the first screen lost {command!r}"


def test_first_screens_commands_are_run_by_the_suite_or_ci():
    blocks = _fenced_blocks(_first_screens())
    commands = [c for lang, body in blocks if lang in ("", "bash", "sh", "console")
                for line in body.splitlines() for c in _commands(line)]
    assert commands, "no command block in the README's first screens"
    ci = _ci_lines()
    for words in commands:
        command = shlex.join(words)
        if words[:2] == ["pip", "install"]:
            assert _torch_pin() in words, f"{command}: the torch pin differs from pyproject.toml's"
            assert words[-2:] in (["-e", "."], ["-e", ".[test]"]), command
            if words[-1] == ".[test]":
                assert any(line.startswith(command) for line in ci), f".ci/run does not install as {command!r}"
        elif words[:3] == ["python", "-m", "pytest"]:
            ci_commands = [shlex.join(shlex.split(line)) for line in ci if line]
            assert command in ci_commands, f".ci/run does not run {command!r}"
        else:
            assert command in RUN_BY, f"{command!r} is run by no test: add one and register it in RUN_BY"
            test_file, function, evidence = RUN_BY[command]
            source = _function_source(test_file, function)
            for piece in evidence:
                assert piece in source, f"{test_file}::{function} no longer runs {command!r} ({piece} missing)"
            if words[0] == "hotswitch":
                _check_hotswitch(words[1:])


def test_first_screens_python_is_checked_against_the_example():
    text = _text(README)
    python_blocks = [body for lang, body in _fenced_blocks(text) if lang == "python"]
    assert len(python_blocks) == len(PYTHON_BLOCK_TESTS), (
        "each of the README's Python blocks is run or checked by a test (PYTHON_BLOCK_TESTS); another needs one")
    for i, (block, test) in enumerate(zip(python_blocks, PYTHON_BLOCK_TESTS)):
        assert block in _first_screens()
        assert f"_readme_python_blocks()[{i}]" in _function_source(*test), test
    langs = {lang for lang, _ in _fenced_blocks(_first_screens())}
    assert langs <= {"", "python"}, f"first-screen code blocks of another kind: {langs}"


def test_every_figure_in_the_readme_names_its_command():
    tables = _tables(_text(README))
    assert any("Headline figures" in heading for heading, _, _ in tables)
    for heading, header, rows in tables:
        figures = any(re.search(r"\d", re.sub(r"`[^`]*`", "", c)) for row in rows for c in row)
        if not figures:
            continue
        lowered = [h.lower() for h in header]
        assert "command" in lowered, f"a table with figures under {heading!r} has no command column"
        column = lowered.index("command")
        for row in rows:
            commands = [s for s in _spans(row[column]) if _is_command(s)]
            assert commands, f"{row[0]!r} under {heading!r} names no command"
            mentioned = {o for c in row for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", c)}
            for command in commands:
                _check_command(command, mentioned if command.startswith("hotswitch ") else ())
        if "Headline figures" in heading:
            assert "machine" in lowered, "the headline figures must say which machine ran them"
            assert all(row[lowered.index("machine")] for row in rows)


def test_hotswitch_commands_in_the_docs_exist():
    """Every `hotswitch ...` command the README and docs/ quote (in code spans and in code blocks,
    after a shell prompt or none) names a command that exists and only options it has."""
    quoted = []
    for path in [README, *DOCS]:
        text = _text(path)
        for body in [b for _, b in _fenced_blocks(text)]:
            quoted += [(path, m) for m in re.findall(r"^(?:\S*\$ )?hotswitch (.*)$", body, re.M)]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        quoted += [(path, s[len("hotswitch "):]) for s in _spans(prose) if s.startswith("hotswitch ")]
    assert quoted
    for path, rest in quoted:
        rest = rest.split("#")[0]
        if ": " in rest or rest.split()[0].isupper():
            continue  # a line of a command's output ("hotswitch demo: gpt-tiny on ..."), or `hotswitch COMMAND`
        words = rest.split()
        parser, cmd, _ = _subcommand(words)
        assert cmd or words[0].startswith("-"), f"{path.name}: 'hotswitch {rest}' names no command"
        unknown = {o.split("=")[0] for o in words if o.startswith("--")} - _options(parser)
        assert not unknown, f"{path.name}: 'hotswitch {' '.join(cmd)}' has no option {sorted(unknown)}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", _text(page), flags=re.M | re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # a web address
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} does not exist"
        if anchor:
            assert path.suffix == ".md" and anchor in _anchors(path), f"{page.name}: no heading for {link}"


def test_docs_pages_start_with_what_a_user_does():
    assert DOCS, "docs/ holds the user's guide"
    for page in DOCS:
        paragraphs = [p for p in _text(page).split("\n\n") if p.strip()]
        assert paragraphs[0].startswith("# "), page.name
        assert paragraphs[1].startswith("What you do"), f"{page.name} does not start with what a user does"


def _project_files() -> list[str]:
    """The files git tracks; outside a git checkout (an unpacked archive), every file under the
    root but caches, builds and environments."""
    try:
        return subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                              timeout=30).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        skip = {".git", "__pycache__", "build", "dist", ".venv", "venv", ".pytest_cache", ".ruff_cache",
                ".hypothesis"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and not p.name.endswith(".egg-info")
                and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


def test_no_tracked_file_speaks_of_sessions_or_issue_numbers():
    files = _project_files()
    pattern = re.compile("ses" "sion [0-9]|is" "sue [0-9]", re.I)  # split so this file does not match
    found = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "the project's files speak of the project, not of its history:\n" + "\n".join(found)
