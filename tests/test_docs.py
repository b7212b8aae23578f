"""The docs as a specification: README.md is a front page that routes into docs/, every relative link
in README.md and docs/ lands on a file (and a heading there), and every command a fenced shell block
shows runs a module or script of this repository with flags that command accepts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"  # generated from the code by scripts of its own; may not exist yet
MAX_README_LINES = 220

SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
COMMENT = re.compile(r"(^|\s)#.*$")
# A pipe only ends a command where a word follows it: `[--no-backoff | --jitter]` is one usage line.
SEPARATOR = re.compile(r"\s*(?:&&|\|\||;|\|(?=\s+[\w./]))\s*")
INVOCATION = re.compile(
    r"(?:^|\s)(?:\S*/)?python3?\s+(?:-m\s+(?P<module>[\w.]+)|(?P<script>(?:bench|scripts)/[\w./-]+\.py))"
    r"|(?:^|\s)bash\s+(?P<bash>scripts/[\w./-]+\.sh)"
)
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
SUBCOMMAND = re.compile(r"^[a-z][a-z0-9-]*$")


def documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def split_markdown(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """The prose outside fenced code blocks, and each fenced block as (language, lines)."""
    prose, blocks, block, fence = [], [], None, None
    for line in text.splitlines():
        match = FENCE.match(line)
        if block is None and match:
            fence, block = match.group(1), (match.group(2).lower(), [])
        elif block is not None and line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
            blocks.append(block)
            block = None
        elif block is not None:
            block[1].append(line)
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation other than '-' and '_' dropped,
    spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one gets -1, -2, ... as on GitHub."""
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose.splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Link and image targets in a Markdown file's prose (not in code, fenced or inline)."""
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    return LINK.findall(INLINE_CODE.sub("", prose))


@dataclass(frozen=True)
class Command:
    """One documented invocation of a module or script of this repository."""

    where: str  # file and the command's text, for messages
    kind: str  # module, script or bash
    target: str  # e.g. index_builder, training.split, bench/load.py, scripts/install.sh
    subcommand: str | None
    flags: tuple[str, ...]

    @property
    def help_args(self) -> tuple[str, ...]:
        """What to run, before --help, to see the flags this command accepts."""
        head = ("-m", self.target) if self.kind == "module" else (self.target,)
        if self.subcommand:
            head += (self.subcommand,)
        if self.kind == "module" and self.target == "service" and "--ray" in self.flags:
            head += ("--ray",)  # sharded serving has a parser of its own
        return head


def shell_lines(lines: list[str]) -> list[str]:
    """Logical command lines of a shell block: comments dropped, a line ending in a backslash or
    followed by an indented one (a wrapped usage line) joined to the next."""
    logical: list[str] = []
    for raw in lines:
        line = COMMENT.sub("", raw).rstrip()
        if not line.strip():
            continue
        if logical and (logical[-1].endswith("\\") or raw[:1].isspace()):
            logical[-1] = logical[-1].rstrip("\\").rstrip() + " " + line.strip()
        else:
            logical.append(line.strip())
    return logical


def repository_package(module: str) -> bool:
    return (ROOT / module.split(".")[0] / "__init__.py").is_file()


def documented_commands() -> list[Command]:
    commands = []
    for path in documents():
        _, blocks = split_markdown(path.read_text(encoding="utf-8"))
        for language, lines in blocks:
            if language not in SHELL_FENCES:
                continue
            for line in shell_lines(lines):
                for segment in SEPARATOR.split(line):
                    match = INVOCATION.search(segment)
                    if match is None or (match["module"] and not repository_package(match["module"])):
                        continue
                    kind = "module" if match["module"] else "script" if match["script"] else "bash"
                    target = match["module"] or match["script"] or match["bash"]
                    rest = segment[match.end():].split()
                    subcommand = rest[0] if kind == "module" and rest and SUBCOMMAND.match(rest[0]) else None
                    flags = () if kind == "bash" else tuple(dict.fromkeys(FLAG.findall(" ".join(rest))))
                    where = f"{path.relative_to(ROOT)}: {segment.strip()[:120]}"
                    commands.append(Command(where, kind, target, subcommand, flags))
    return commands


def exists(command: Command) -> bool:
    if command.kind != "module":
        return (ROOT / command.target).is_file()
    parts = command.target.split(".")
    folder = ROOT.joinpath(*parts)
    if len(parts) == 1:
        return (folder / "__main__.py").is_file()
    return folder.with_suffix(".py").is_file() or (folder / "__main__.py").is_file()


# Most commands import torch before they parse a flag: seconds each, on two cores. So one process imports
# the heavy libraries once and forks a child per command, which runs it as `python -m MODULE` or `python
# SCRIPT` would (runpy) with --help; an alarm ends a child that hangs.
HELP_RUNNER = r"""
import json, os, runpy, signal, sys, tempfile
for library in ("torch", "transformers", "faiss", "numpy", "fastapi", "pydantic_settings", "httpx", "uvicorn"):
    try:
        __import__(library)
    except ImportError:
        pass
answers = []
for args in json.load(sys.stdin):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    child = os.fork()
    if child == 0:
        signal.alarm(120)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        module = args[0] == "-m"
        sys.argv = [args[1] if module else args[0], *args[2 if module else 1:], "--help"]
        code = 0
        try:
            if module:
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(child, 0)
    out.seek(0)
    err.seek(0)
    answers.append([os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
json.dump(answers, sys.stdout)
"""


@dataclass(frozen=True)
class Help:
    returncode: int
    stdout: str
    stderr: str


def run_help(commands: list[tuple[str, ...]]) -> dict[tuple[str, ...], Help]:
    """Each command's `--help`, run from the repository root."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER], input=json.dumps(commands), cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return {command: Help(*answer) for command, answer in zip(commands, json.loads(result.stdout))}


@pytest.fixture(scope="module")
def commands() -> list[Command]:
    found = documented_commands()
    assert found, "no commands found in the docs' shell blocks: the parser is broken"
    return found


@pytest.fixture(scope="module")
def help_texts(commands) -> dict[tuple[str, ...], Help]:
    """Each distinct command's --help, once."""
    wanted = {c.help_args for c in commands if c.kind != "bash" and (c.flags or c.subcommand) and exists(c)}
    return run_help(sorted(wanted))


def test_readme_is_a_front_page_of_at_most_220_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference text into docs/"


def test_readme_shows_the_test_command_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    _, blocks = split_markdown(README.read_text(encoding="utf-8"))
    shown = {line for _, lines in blocks for line in lines}
    assert ci[-1] in shown, f"README.md must show CI's command verbatim: {ci[-1]}"


def test_readme_links_into_every_page_of_docs():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links(README)}
    pages = {page.resolve() for page in DOCS.rglob("*.md")}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []


def test_every_relative_link_resolves_to_a_file_and_its_heading():
    broken = []
    for path in documents():
        for target in links(path):
            if SCHEME.match(target):
                continue  # http, https, mailto: not this repository's
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if linked == CONFIGURATION.resolve() and not linked.exists():
                continue  # generated by another script, not yet written
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no heading #{anchor} in {linked.name})")
    assert broken == []


def test_every_documented_command_runs_a_module_or_script_that_exists(commands):
    missing = [f"{c.where} ({c.target} does not exist)" for c in commands if not exists(c)]
    assert missing == []


def test_every_documented_subcommand_and_flag_is_accepted_by_its_command(commands, help_texts):
    wrong = []
    for command in commands:
        if command.help_args not in help_texts:
            continue
        result = help_texts[command.help_args]
        if result.returncode != 0:
            wrong.append(f"{command.where}: `{' '.join(command.help_args)} --help` failed: {result.stderr[-300:]}")
            continue
        for flag in command.flags:
            if flag != "--help" and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout):
                wrong.append(f"{command.where}: {flag} is not a flag of `{' '.join(command.help_args)}`")
    assert wrong == []
