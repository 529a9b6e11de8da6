"""`genq --help`: every flag says what it does, shows its default, and names its GENQ_
variable where a setting backs it; every variable it names exists."""

from __future__ import annotations

import argparse
import re

import pytest

from genq.cli import build_parser
from genq.client import API_KEY_ENV, URL_ENV
from shared.settings import Settings

NO_HELP_NEEDED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _parsers(
    top: argparse.ArgumentParser | None = None, name: str = "genq"
) -> dict[str, argparse.ArgumentParser]:
    """Every parser, commands of commands (`genq batch submit`) included."""
    top = top or build_parser()
    out = {name: top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, parser in action.choices.items():
                out.update(_parsers(parser, f"{name} {sub}"))
    return out


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, NO_HELP_NEEDED)]


@pytest.mark.parametrize("name", list(_parsers()))
def test_every_flag_has_help(name: str) -> None:
    missing = [a.option_strings or a.dest for a in _options(_parsers()[name]) if not a.help]
    assert not missing, f"{name}: no help for {missing}"


@pytest.mark.parametrize("name", list(_parsers()))
def test_no_help_says_its_default_twice(name: str) -> None:
    twice = [
        a.option_strings or a.dest
        for a in _options(_parsers()[name])
        if (a.help or "").count("default") > 1
    ]
    assert not twice, f"{name}: {twice}"


@pytest.mark.parametrize("name", list(_parsers()))
def test_every_variable_named_in_help_is_a_setting(name: str) -> None:
    text = _parsers()[name].format_help()
    named = set(re.findall(r"GENQ_[A-Z0-9_]+", text)) - {API_KEY_ENV, URL_ENV}  # clients' own
    unknown = {v for v in named if v.removeprefix("GENQ_").lower() not in Settings.model_fields}
    assert not unknown, f"{name} names {unknown}"


def test_a_flag_backed_by_a_setting_shows_its_default_and_variable() -> None:
    for parser in _parsers().values():
        for action in _options(parser):
            field = Settings.model_fields.get(action.dest)
            if not action.option_strings or field is None:
                continue
            assert f"env GENQ_{action.dest.upper()}" in (action.help or ""), action.dest
            if field.default is not None:
                assert "default:" in (action.help or ""), action.dest


def test_flags_without_a_setting_show_their_default() -> None:
    serve = _parsers()["genq serve"]
    by_flag = {s: a for a in serve._actions for s in a.option_strings}
    assert "default: 127.0.0.1" in (by_flag["--host"].help or "")
    assert "default: 8000" in (by_flag["--port"].help or "")


CLIENTS = [n for n in _parsers() if n.split()[1:2] in (["submit"], ["bench"], ["batch"])]


@pytest.mark.parametrize("name", [n for n in CLIENTS if n != "genq batch"])
def test_client_commands_say_they_read_genq_url(name: str) -> None:
    by_flag = {s: a for a in _parsers()[name]._actions for s in a.option_strings}
    assert f"${URL_ENV}" in (by_flag["--url"].help or "")


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_redis_url_is_a_flag_of_every_command_that_uses_redis(command: str) -> None:
    args = _parsers()["genq"].parse_args([command, "--redis-url", "redis://r:6379/0"])
    assert args.redis_url == "redis://r:6379/0"
