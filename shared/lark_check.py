"""Can a Lark grammar ever finish? A check llguidance does not make.

llguidance accepts `start: a` with `a: "x" a`: every string it admits goes on for ever, so a
job under it runs until max_tokens and never ends by the grammar. Such a grammar is refused
before its job exists: `unfinishable` finds whether `start` derives some finite string.

The classic fixpoint over the rules: a rule is *productive* when one of its alternatives has
only productive items; literals, regexes, special tokens, `%json {…}` and `@grammar`
references are productive; an item under `?`, `*`, `[…]` or a `{0,…}` repeat may be left out.
Names the grammar does not define (`%import`ed ones) count as productive: llguidance itself
refuses an undefined name. The grammar is only tokenized and parsed as far as this needs: a
syntax error here is left for llguidance's own (better) message.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsulx]*)
  | (?P<special><\[[^\]]*\]>|<[^<>\s]+>)
  | (?P<subgrammar>@[A-Za-z_][A-Za-z0-9_]*)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<punct>::=|:|\||\(|\)|\[|\]|\?|\*|\+|\.\.|,|=|->|\{|\})
  | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_ATOMS = frozenset({"string", "regex", "special", "subgrammar"})


def unfinishable(lark: str) -> str | None:
    """Why `lark` can never produce a finite string (a message), or None if it can (or if
    this parser cannot tell: llguidance judges the rest)."""
    try:
        rules = _rules(_tokens(lark))
    except _Unparsed:
        return None
    if "start" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and any(
                _seq_ok(seq, rules, productive) for seq in alternatives
            ):
                productive.add(name)
                changed = True
    if "start" in productive:
        return None
    stuck = sorted(n for n in rules if n not in productive)
    return (
        "no finite output can complete it: rule(s) "
        + ", ".join(stuck[:5])
        + (" …" if len(stuck) > 5 else "")
        + " can never end"
    )


class _Unparsed(Exception):
    pass


Item = tuple[str, object]  # ("atom", None) | ("ref", name) | ("group", [seq, ...]) | ("opt", _)
Seq = list[Item]


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup or "other"
        if kind != "ws":
            out.append((kind, m.group()))
    return out


def _rules(tokens: list[tuple[str, str]]) -> dict[str, list[Seq]]:
    """Rule (and terminal) name → its alternatives, from `name: …` definitions; directives
    (`%import`, `%ignore`, `%llguidance {…}`) are skipped."""
    rules: dict[str, list[Seq]] = {}
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "directive":
            i = _skip_directive(tokens, i)
            continue
        if kind != "name":
            raise _Unparsed
        j = i + 1
        if j < len(tokens) and tokens[j][1] == "[":  # name[lazy, stop=…]: parameters
            while j < len(tokens) and tokens[j][1] != "]":
                j += 1
            j += 1
        if j < len(tokens) and tokens[j][0] == "punct" and tokens[j][1] == ".":
            j += 2  # NAME.priority
        if j >= len(tokens) or tokens[j][1] not in (":", "::="):
            raise _Unparsed
        end = _definition_end(tokens, j + 1)
        body, k = _alternatives(tokens, j + 1, end)
        if k != end:
            raise _Unparsed
        rules.setdefault(text.lstrip("?!"), []).extend(body)
        i = end
    return rules


def _skip_directive(tokens: list[tuple[str, str]], i: int) -> int:
    """Past a directive: its line's tokens (a `{…}` block counted as a whole)."""
    i += 1
    depth = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if depth == 0 and i + 1 < len(tokens) and _starts_definition(tokens, i):
            return i
        if depth == 0 and kind == "directive":
            return i
        depth += text == "{"
        depth -= text == "}"
        i += 1
        if depth == 0 and text == "}":
            return i
    return i


def _starts_definition(tokens: list[tuple[str, str]], i: int) -> bool:
    if tokens[i][0] != "name":
        return False
    j = i + 1
    if j < len(tokens) and tokens[j][1] == "[":
        while j < len(tokens) and tokens[j][1] != "]":
            j += 1
        j += 1
    return j < len(tokens) and tokens[j][1] in (":", "::=")


def _definition_end(tokens: list[tuple[str, str]], i: int) -> int:
    """Where the definition starting at `i` ends: at the next `name:` or directive outside
    brackets."""
    depth = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if depth == 0 and (kind == "directive" or _starts_definition(tokens, i)):
            return i
        if text in ("(", "[", "{"):
            depth += 1
        elif text in (")", "]", "}"):
            depth -= 1
        i += 1
    return i


def _alternatives(tokens: list[tuple[str, str]], i: int, end: int) -> tuple[list[Seq], int]:
    alts: list[Seq] = []
    seq: Seq = []
    while i < end:
        text = tokens[i][1]
        if text in (")", "]"):
            break
        if text == "|":
            alts.append(seq)
            seq = []
            i += 1
            continue
        item, i = _item(tokens, i, end)
        if item is not None:
            seq.append(item)
    alts.append(seq)
    return alts, i


def _item(tokens: list[tuple[str, str]], i: int, end: int) -> tuple[Item | None, int]:
    kind, text = tokens[i]
    item: Item
    if kind in _ATOMS:
        item, i = ("atom", None), i + 1
    elif kind == "directive" and text == "%json":
        i = _skip_braces(tokens, i + 1)
        item = ("atom", None)
    elif kind == "name":
        item, i = ("ref", text.lstrip("?!")), i + 1
    elif text in ("(", "["):
        close = ")" if text == "(" else "]"
        body, i = _alternatives(tokens, i + 1, end)
        if i >= end or tokens[i][1] != close:
            raise _Unparsed
        i += 1
        item = ("group", body) if close == ")" else ("opt", None)
    elif kind in ("punct", "repeat", "range") and text in ("->", ","):
        return None, i + 1
    else:
        raise _Unparsed
    while i < end:  # postfix operators
        kind, text = tokens[i]
        if text in ("?", "*"):
            item, i = ("opt", None), i + 1
        elif text == "+":
            i += 1
        elif kind == "repeat":
            low = text.strip("{} ").split(",")[0].strip()
            item = ("opt", None) if low in ("", "0") else item
            i += 1
        elif kind == "range":
            low = text.lstrip("~ ").split("..")[0].strip()
            item = ("opt", None) if low == "0" else item
            i += 1
        elif text == "..":  # "a".."z"
            i += 2
        else:
            break
    return item, i


def _skip_braces(tokens: list[tuple[str, str]], i: int) -> int:
    depth = 0
    while i < len(tokens):
        text = tokens[i][1]
        depth += text == "{"
        depth -= text == "}"
        i += 1
        if depth == 0:
            return i
    raise _Unparsed


def _seq_ok(seq: Seq, rules: dict[str, list[Seq]], productive: set[str]) -> bool:
    return all(_item_ok(item, rules, productive) for item in seq)


def _item_ok(item: Item, rules: dict[str, list[Seq]], productive: set[str]) -> bool:
    kind, value = item
    if kind in ("atom", "opt"):
        return True
    if kind == "ref":
        assert isinstance(value, str)
        return value in productive or value not in rules
    assert isinstance(value, list)
    return any(_seq_ok(seq, rules, productive) for seq in value)
