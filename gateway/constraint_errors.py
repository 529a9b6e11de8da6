"""What a 400 about a constraint says: llguidance's reason, and where it is in what the client
sent.

llguidance's messages are several lines, written for the grammar it was given: for a regex,
`at 1(8): invalid regex "([a-z" (in regex): regex parse error:` then the regex, a line of
carets under the fault, `error: unclosed character class`, then an excerpt of genq's own
grammar (`start: /([a-z/`), whose line and column mean nothing to the client. `reason` keeps
the reason and the position in the client's own text: the column in a regex, the line and
column in a Lark grammar. A schema's regexes have no position in llguidance's message at all:
`patterns` lists them with their path in the schema, so the gateway checks each on its own
and names it (`properties.code.pattern`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from shared.constraints import ConstraintKind, llg_error
from shared.errors import SHOWN_CHARS

REASON_CHARS = 500
"""Most characters of llguidance's reason a message keeps."""
EXCERPT_CHARS = 24
"""Most characters of the client's text shown from where a regex goes wrong."""

_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")
"""llguidance's `line(column): ` before a message about a place in a Lark grammar."""
_REGEX_ERROR = "regex parse error:"
_INDENT = 4
"""The regex parser's message shows the regex indented by this many spaces."""

_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "not", "if")
_SUBSCHEMA_MORE = ("then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
"""Where a JSON schema holds schemas: one, a list of them, a map of names to them."""


def reason(kind: ConstraintKind, error: str, positions: bool = True) -> str:
    """llguidance's `error` about a constraint of `kind` as the client can act on it: its
    reason, and where in their regex or grammar (not in genq's grammar around it).
    `positions` False: a grammar genq wrote, whose lines and columns are not the client's."""
    text = error.strip()
    where = ""
    at = _POSITION.match(text)
    if at is not None:
        text = text[at.end() :]
        if kind == "grammar" and positions:  # the client's own Lark text
            where = f"line {at[1]}, column {at[2]}: "
    head, found, rest = text.partition(_REGEX_ERROR)
    if found:
        detail = _regex_fault(rest)
        if kind == "grammar":  # which of its regexes: llguidance quotes it
            head = head.strip().removesuffix(":").removesuffix("(in regex)").strip()
            return f"{where}{head}: {detail}"[:REASON_CHARS]
        return detail[:REASON_CHARS]
    lines = [line for line in text.splitlines() if line.strip()]
    first = llg_error(lines[0]) if lines else "invalid"
    return f"{where}{first}"[:REASON_CHARS]


def _regex_fault(display: str) -> str:
    """The regex parser's display (the regex, carets under the fault, `error: why`) as
    `why at column N (`text from there`)`; the reason alone when the display is another."""
    lines = display.split("\n")
    why = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")), None)
    if why is None:
        return llg_error(display) or "invalid regex"
    carets = next((i for i, ln in enumerate(lines) if ln.strip() and set(ln.strip()) <= {"^"}), -1)
    if carets < 1:
        return why
    regex, marks = lines[carets - 1][_INDENT:], lines[carets][_INDENT:]
    start = marks.find("^")
    span = len(marks[start:]) - len(marks[start:].lstrip("^"))
    shown = regex[start : start + span] if span > 1 else regex[start:]
    return f"{why} at column {start + 1} (`{_printable(shown, EXCERPT_CHARS)}`)"


def _printable(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters (with an ellipsis), anything unprintable escaped; a
    regex's backslashes stay as written."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + "…" if len(text) > limit else out


def patterns(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Each regex of a JSON schema, with where it is (`properties.code.pattern`, or
    `patternProperties.<regex>` for a property-name regex): every `pattern` and
    `patternProperties` name among its schemas, in document order."""
    if not isinstance(schema, dict):
        return
    here = f"{path}." if path else ""
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        yield f"{here}pattern", pattern
    by_name = schema.get("patternProperties")
    if isinstance(by_name, dict):
        for name, sub in by_name.items():
            inner = f"{here}patternProperties.{_printable(str(name))}"
            yield inner, str(name)
            yield from patterns(sub, inner)
    for key in (*_SUBSCHEMA, *_SUBSCHEMA_MORE):
        sub = schema.get(key)
        if isinstance(sub, list):  # `items` as a list (older drafts' tuple form)
            for i, item in enumerate(sub):
                yield from patterns(item, f"{here}{key}.{i}")
        else:
            yield from patterns(sub, f"{here}{key}")
    for key in _SCHEMA_LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, item in enumerate(subs):
                yield from patterns(item, f"{here}{key}.{i}")
    for key in _SCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, item in subs.items():
                yield from patterns(item, f"{here}{key}.{_printable(str(name))}")
