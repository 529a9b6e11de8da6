"""`genq settings`: every `GENQ_` variable with its default, the processes that read it and
what it does — from the settings classes themselves, so the list cannot drift from the code.
`--markdown` writes the table docs/settings.md holds (a test keeps the two equal)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from shared.settings import (
    EngineSettings,
    GatewaySettings,
    JobSettings,
    RedisSettings,
    WorkerSettings,
)

SECTIONS: list[tuple[str, type[BaseSettings]]] = [
    ("Redis (every process)", RedisSettings),
    ("Jobs (gateways and workers)", JobSettings),
    ("Gateway", GatewaySettings),
    ("Engine (workers)", EngineSettings),
    ("Worker", WorkerSettings),
]
"""Each section lists the settings its class adds to those listed before it."""

HEADER = """# Settings

Every setting of every genq process, as `genq settings --markdown` prints it (generated from
`shared/settings.py`; a test keeps this file equal to that output). Each is an environment
variable; command-line flags, where a command has one, override it. `genq serve` reads all of
them; `genq gateway` the Redis, Jobs and Gateway sections; `genq worker` the Redis, Jobs, Engine
and Worker sections.
"""
TABLE_HEAD = "| variable | default | meaning |\n|---|---|---|\n"


@dataclass(frozen=True)
class Entry:
    section: str
    variable: str
    default: str
    meaning: str


def entries() -> Iterator[Entry]:
    """One per setting, section by section, each in the order its class declares them."""
    seen: set[str] = set()
    for section, cls in SECTIONS:
        for name, info in cls.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            yield Entry(
                section=section,
                variable=f"GENQ_{name.upper()}",
                default=_default(info),
                meaning=(info.description or "").strip(),
            )


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "unset"
    if value == [] or value == {}:
        return "empty"
    if isinstance(value, str):
        return value or "empty"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, default=lambda v: v.model_dump() if hasattr(v, "model_dump") else v)


def markdown() -> str:
    out, section = [HEADER], None
    for e in entries():
        if e.section != section:
            section = e.section
            out.append(f"\n## {section}\n\n{TABLE_HEAD}")
        out.append(f"| `{e.variable}` | `{e.default}` | {_cell(e.meaning)} |\n")
    return "".join(out)


def plain() -> str:
    out, section = [], None
    for e in entries():
        if e.section != section:
            section = e.section
            out.append(f"# {section}")
        out.append(f"{e.variable}={e.default}" + (f"\n    {e.meaning}" if e.meaning else ""))
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
