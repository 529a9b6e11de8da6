"""Each Lua script and its Python calls agree on its arguments: the script names them only
through its declaration's `K`/`A` (shared/scripts.py), every name it uses is declared and every
declared one used; a call with a name missing or unknown is refused before it is sent, and one
that brings a wrong count is refused by the script."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis
from redis.exceptions import ResponseError

from shared.scripts import DECLARED, JOB, LEASE, SUBMIT, ScriptArgs
from shared.transitions import script
from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix

LUA = resources.files("shared") / "lua"
SCRIPTS = sorted(p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua"))
POSITIONAL = re.compile(r"\bKEYS\s*\[|\bARGV\s*\[\s*\d|unpack\(\s*ARGV\s*,\s*\d")


def _body(name: str) -> str:
    text = (LUA / f"{name}.lua").read_text(encoding="utf-8")
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())  # code, not comments


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s != "prelude"])
def test_every_script_is_declared_and_names_its_arguments_as_declared(name: str) -> None:
    declared = DECLARED.get(name)
    assert declared is not None, f"{name}.lua has no ScriptArgs in shared/scripts.py"
    body = _body(name)
    assert not POSITIONAL.findall(body), f"{name}.lua reads KEYS/ARGV by position, not by name"
    # a job's three keys travel together (they name its Cluster slot), read or not
    for table, names in (("K", declared.keys), ("A", declared.argv)):
        used = set(re.findall(rf"\b{table}\.(\w+)", body))
        assert used <= set(names), f"{name}.lua uses {table}.{sorted(used - set(names))}"
        unused = set(names) - used - (set(JOB) if table == "K" else set())
        assert not unused, f"{name}.lua never reads {table}.{sorted(unused)}"
    assert ("REST" in re.findall(r"\bREST\b", body)) == bool(declared.rest), (
        f"{name}.lua and its declaration disagree on a variadic tail (REST)"
    )


def test_every_declaration_is_of_a_script() -> None:
    assert set(DECLARED) <= set(SCRIPTS)


def test_a_call_missing_or_adding_a_name_is_refused_before_it_is_sent() -> None:
    keys = {"lease": "k"}
    with pytest.raises(ValueError, match="ARGV ttl_ms missing"):
        LEASE.pack(keys, {"token": "t", "action": "hold"})
    with pytest.raises(ValueError, match="ARGV ttl not declared"):
        LEASE.pack(keys, {"token": "t", "action": "hold", "ttl_ms": 1, "ttl": 2})
    with pytest.raises(ValueError, match="KEYS lease missing"):
        LEASE.pack({}, {"token": "t", "action": "hold", "ttl_ms": 1})
    with pytest.raises(ValueError, match="no ARGV after"):
        LEASE.pack(keys, {"token": "t", "action": "hold", "ttl_ms": 1}, ["extra"])
    assert LEASE.pack(keys, {"ttl_ms": 5, "action": "hold", "token": "t"}) == (
        ["k"],
        ["t", "hold", 5],
    )
    assert SUBMIT.prologue().count("KEYS[") == len(SUBMIT.keys)


def test_a_declaration_names_each_argument_once() -> None:
    with pytest.raises(ValueError, match="distinct"):
        ScriptArgs("x", keys=("a", "a"))
    with pytest.raises(ValueError, match="distinct"):
        ScriptArgs("x", keys=(), argv=("not a name",))


def test_the_script_refuses_a_call_with_a_count_other_than_declared() -> None:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    key_prefix = test_prefix("script-args")
    lease = f"{key_prefix}lease"
    try:
        source = script("lease").source
        assert client.eval(source, 1, lease, "t", "hold", 1000) == 1
        with pytest.raises(ResponseError, match="lease: 1 KEYS and 3 ARGV expected, got 1 and 2"):
            client.eval(source, 1, lease, "t", "hold")
        with pytest.raises(ResponseError, match="got 2 and 3"):
            client.eval(source, 2, lease, lease, "t", "hold", 1000)
        batch = script("batch_update").source  # a variadic tail: at least the named ones
        with pytest.raises(ResponseError, match="at least 4 ARGV expected"):
            client.eval(batch, 3, f"{key_prefix}b", lease, f"{key_prefix}o", "")
    finally:
        client.delete(lease)
        client.close()
