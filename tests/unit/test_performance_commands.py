"""Every command docs/performance.md gives to reproduce a figure still runs: each `python -m
MODULE …` and `genq COMMAND …` there (in a fenced block, or an inline code span) answers
`--help` with exit 0, and every flag the command uses appears in that help. A renamed module
or a dropped flag fails here instead of leaving a figure nobody can reproduce."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from genq.cli import build_parser

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "performance.md"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
# `python -m M --help` for many modules in one interpreter, so their shared imports (FastAPI,
# the gateway, redis) load once: a few seconds in all instead of a few each.
HELP_ALL = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
out = {}
for module in json.loads(sys.argv[1]):
    sys.argv = [module, "--help"]
    buf = io.StringIO()
    code = None
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = repr(exc)
    out[module] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Command:
    text: str
    program: str  # a module for `python -m`, or "genq"
    words: tuple[str, ...]  # after the program

    def flags(self) -> list[str]:
        found = []
        for word in self.words:
            word = word.strip("[]()")
            if re.match(r"^--?[A-Za-z]", word):
                found.append(word.split("=", 1)[0])
        return found


def _logical_lines(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines()]


def _command(line: str) -> Command | None:
    line = re.sub(r"\s#.*$", "", line).strip().rstrip("&").strip()
    words = line.split()
    while words and ENV.match(words[0]):
        words = words[1:]
    if words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2:
        return Command(line, words[2], tuple(words[3:]))
    if words[:1] == ["genq"]:
        return Command(line, "genq", tuple(words[1:]))
    return None


def commands(text: str) -> list[Command]:
    found = []
    for block in FENCE.findall(text):
        for line in _logical_lines(block):
            for part in re.split(r"\s(?:&&|;|\|\|)\s", line):
                if (c := _command(part)) is not None:
                    found.append(c)
    prose = FENCE.sub("", text)
    found += [c for span in INLINE.findall(prose) if (c := _command(span)) is not None]
    return found


COMMANDS = commands(PAGE.read_text())


def _genq_parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    """The deepest `genq` (sub)command the words name: `genq batch submit F` → batch submit."""
    parser = build_parser()
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


@pytest.fixture(scope="module")
def module_help() -> dict[str, tuple[object, str]]:
    modules = sorted({c.program for c in COMMANDS if c.program != "genq"})
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    return {m: (code, text) for m, (code, text) in json.loads(done.stdout).items()}


def test_the_page_gives_commands_for_its_figures() -> None:
    programs = {c.program for c in COMMANDS}
    assert {"genq.benchgpu", "tests.bench.pipeline", "tests.chaos.bench_recovery"} <= programs
    assert "genq" in programs


def test_the_parser_finds_flags_through_continuations_and_env_prefixes() -> None:
    text = "```sh\nGENQ_X=1 python -m a.b --one 1 \\\n    --two=2 [--three] # --not-this\n```\n"
    [c] = commands(text)
    assert c.program == "a.b" and c.flags() == ["--one", "--two", "--three"]
    assert [c.program for c in commands("run `genq serve --port 8000` then")] == ["genq"]


MODULE_COMMANDS = [c for c in COMMANDS if c.program != "genq"]
GENQ_COMMANDS = [c for c in COMMANDS if c.program == "genq"]


@pytest.mark.parametrize("command", MODULE_COMMANDS, ids=lambda c: c.text)
def test_every_module_command_answers_help_with_its_flags(
    command: Command, module_help: dict[str, tuple[object, str]]
) -> None:
    code, text = module_help[command.program]
    assert code in (0, None), f"`python -m {command.program} --help`: {code}\n{text}"
    missing = [f for f in command.flags() if not re.search(rf"(?<![\w-]){f}(?![\w-])", text)]
    assert not missing, f"{command.text}: {missing} not in `python -m {command.program} --help`"


@pytest.mark.parametrize("command", GENQ_COMMANDS, ids=lambda c: c.text)
def test_every_genq_command_has_its_flags(command: Command) -> None:
    parser = _genq_parser(command.words)
    assert parser.prog != build_parser().prog, f"{command.text}: no such genq command"
    text = parser.format_help()
    missing = [f for f in command.flags() if not re.search(rf"(?<![\w-]){f}(?![\w-])", text)]
    assert not missing, f"{command.text}: {missing} not in its `--help`"
