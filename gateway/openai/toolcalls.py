"""Tool calling: OpenAI's `tools` and `tool_choice` as a constraint in the model's own
tool-call format, and the model's output read back as OpenAI's `tool_calls`.

genq reads and writes three families' formats, recognised from the chat template:

- Hermes / Qwen (`<tool_call>` in the template): `<tool_call>\n{"name": …, "arguments": {…}}\n
  </tool_call>` per call, a newline between;
- Mistral (`[TOOL_CALLS]`): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`;
- Llama 3.1+ JSON (`<|python_tag|>`, or `ipython` and `parameters`): `{"name": …,
  "parameters": {…}}`, `; ` between calls.

A request with tools for a model whose template shows none of them is a 400
(`tools_unsupported`): genq never puts tools in a prompt the model was not trained to read.

The call is generated under a constraint from its trigger on (never parsed from free text
after the fact): the grammar (`grammar_for`) admits, by `tool_choice`,
- `auto`: free text, or free text then the calls (Hermes, Mistral: the trigger is a special
  token or string; Llama: a reply that starts with `{` is a call);
- `required`: one call or more, nothing before; a named function: exactly that one;
- `none`: no constraint (the tools are still rendered into the prompt, as OpenAI does).
Each call's JSON is `{"name": <one of the tools>, "arguments": <its parameters schema>}`
(`parameters` for Llama), and `parallel_tool_calls: false` admits one call. A function's
`strict` (OpenAI's default: false) decides what happens to a keyword of its parameters the
grammar cannot enforce, as for a response format (gateway/openai/structured.py).

With a JSON `response_format` beside `auto` tools, the reply is either the calls or JSON
under the format's schema (nothing before either): Hermes and Mistral calls start with their
trigger, which JSON cannot. A Llama JSON call is itself a JSON object, which a reply in the
schema could be too: that pair is a 400 (`tools_with_response_format`).

`ToolCallReader` turns the output text back into `content` and `tool_calls`, piece by piece
for a stream (OpenAI's deltas: index, id, type and name first, then argument fragments), in
memory bounded by one call's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.constraints import json_options
from shared.errors import BadRequest

MAX_TOOLS = 128
"""OpenAI's limit on `tools`."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

Family = Literal["hermes", "mistral", "llama3"]


@dataclass(frozen=True)
class ToolFormat:
    family: Family
    trigger: str
    """What starts the calls ('' for Llama's JSON: a reply that starts with `{`)."""
    each: bool
    """Every call starts with the trigger (Hermes), not only the first (Mistral)."""
    open: str
    """After the trigger, before a call's JSON."""
    close: str
    """After each call's JSON (may hold a special token, e.g. `</tool_call>`)."""
    between: str
    """Between two calls."""
    end: str
    """After the last call."""
    args_key: str


FORMATS: dict[Family, ToolFormat] = {
    "hermes": ToolFormat(
        "hermes", "<tool_call>", True, "\n", "\n</tool_call>", "\n", "", "arguments"
    ),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", False, "[", "", ", ", "]", "arguments"),
    "llama3": ToolFormat("llama3", "", False, "", "", "; ", "", "parameters"),
}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
"""The markers a tokenizer may hold as one special token (then written `<…>` in a grammar)."""


TOOLS_ORIGIN = "tools:"
"""A tools constraint's `origin`: then its family (`tools:hermes`)."""


def tool_format_of(constraint: Any) -> ToolFormat | None:
    """The tool-call format of a job under a tools constraint (`shared.constraints.Constraint`
    with origin `tools:<family>`), else None."""
    origin = getattr(constraint, "origin", None) or ""
    if not origin.startswith(TOOLS_ORIGIN):
        return None
    family = origin[len(TOOLS_ORIGIN) :]
    return next((f for name, f in FORMATS.items() if name == family), None)


def family_of(template: str | None) -> Family | None:
    """The tool-call family a chat template speaks, or None (it takes no tools)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3"
    return None


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked."""

    functions: list[dict[str, Any]]
    """Each tool's `function` object (name, description, parameters, strict)."""
    choice: Literal["none", "auto", "required"] | str
    """`none`, `auto`, `required`, or the one function's name."""
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice != "none"

    @property
    def lenient(self) -> bool:
        """Some function is not `strict`: its parameters' unenforceable keywords are left out
        of the grammar (a strict one's were refused before)."""
        return not all(f.get("strict") is True for f in self.functions)


def check_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> Tools | None:
    """The request's tools, or None without any; BadRequest naming the field for a shape
    OpenAI would refuse."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools has {len(tools)} tools; the limit is {MAX_TOOLS}", param="tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(
                f"tools.{i} must be {{'type': 'function', 'function': {{…}}}}", param=f"tools.{i}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(
                f"tools.{i}.function.name must be 1-64 letters, digits, '_' or '-'",
                param=f"tools.{i}.function.name",
            )
        if any(f["name"] == name for f in functions):
            raise BadRequest(
                f"tools.{i}.function.name {name!r} is not unique", param=f"tools.{i}.function.name"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(
                f"tools.{i}.function.parameters must be a JSON schema (an object)",
                param=f"tools.{i}.function.parameters",
            )
        functions.append({**fn, "parameters": params})
    choice = _choice(tool_choice, [f["name"] for f in functions])
    return Tools(functions, choice, True if parallel is None else parallel)


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" if isinstance(tool_choice, dict) else True:
        raise BadRequest(
            "tool_choice is 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': …}}",
            param="tool_choice",
        )
    if name not in names:
        raise BadRequest(
            f"tool_choice names {name!r}, which is not one of tools: {names}",
            param="tool_choice.function.name",
        )
    return str(name)


def call_schema(fmt: ToolFormat, tools: Tools) -> dict[str, Any]:
    """The JSON schema of one call: the name of a tool the choice allows, and its arguments."""
    allowed = [f for f in tools.functions if tools.choice in ("auto", "required", f["name"])]
    at = [f"#/anyOf/{i}" for i in range(len(allowed))] if len(allowed) > 1 else ["#"]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                fmt.args_key: rebased(f["parameters"], f"{where}/properties/{fmt.args_key}"),
            },
            "required": ["name", fmt.args_key],
            "additionalProperties": False,
        }
        for f, where in zip(allowed, at, strict=True)
    ]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": json_options(tools.lenient)}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are data, not schemas: a `$ref` inside them is not a reference."""


def rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references (`#`, `#/$defs/…`) pointing into where it now lies
    (`base`, a JSON pointer) in the larger schema of a call: a tool's parameters written by
    pydantic refer to their own `$defs`, which embedding would otherwise cut off."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebased(value, base)
    return out


def grammar_for(
    fmt: ToolFormat, tools: Tools, special: frozenset[str], answer: dict[str, Any] | None = None
) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `tools`; `special`: the
    markers that are one special token of the model's tokenizer (a grammar names those as
    `<…>`; others are spelled out); `answer`: the JSON schema (with its `x-guidance`) a reply
    that calls no tool is in, with `auto` tools beside a response format."""
    call = f"%json {json.dumps(call_schema(fmt, tools))}"
    trigger = _seq(fmt.trigger, special)
    first = f"{trigger} {_seq(fmt.open, special)} {call} {_seq(fmt.close, special)}"
    later = first if fmt.each else f"{_seq(fmt.open, special) if not fmt.trigger else ''} {call}"
    if not fmt.each:  # one trigger, then the calls
        later = f"{call} {_seq(fmt.close, special)}"
    more = f"({_seq(fmt.between, special)} {later})*" if tools.parallel else ""
    calls = " ".join(f"{first} {more} {_seq(fmt.end, special)}".split())
    rules = ["%llguidance {}"]
    if tools.choice != "auto":
        rules.append(f"start: {calls}")
    elif answer is not None:
        rules.append(f"start: %json {json.dumps(answer)} | {calls}")
    elif fmt.trigger and fmt.trigger in special:
        rules += [f"start: TEXT | TEXT {calls}", "TEXT: /(.|\\n)*/"]
    elif fmt.trigger:
        rest = calls[len(trigger) :].strip()
        rules += [f"start: TEXT | pre {rest}", f"pre[lazy]: TEXT {trigger}", "TEXT: /(.|\\n)*/"]
    else:  # Llama: a reply is a call when it starts with `{`
        rules += [f"start: PROSE | {calls}", "PROSE: /([^{](.|\\n)*)?/"]
    return "\n".join(rules) + "\n"


def _seq(text: str, special: frozenset[str]) -> str:
    """`text` as grammar items: its special markers as tokens, the rest as literals."""
    if not text:
        return ""
    items: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in special if m in rest]
        if not hits:
            items.append(json.dumps(rest))
            break
        at, marker = min(hits)
        if at:
            items.append(json.dumps(rest[:at]))
        items.append(marker)
        rest = rest[at + len(marker) :]
    return " ".join(items)


def template_tools(tools: Tools) -> list[dict[str, Any]]:
    """The tools as Hugging Face chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in tools.functions]


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's `tool_calls` as templates read them: `arguments` a mapping
    (OpenAI sends a JSON string; Hugging Face templates write it with `tojson`)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for c in calls:
        fn = dict(c.get("function") or {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                pass
        out.append({**c, "function": fn} if isinstance(c, dict) else c)
    return {**message, "tool_calls": out}


# ---- reading the output back --------------------------------------------------------------


@dataclass
class CallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCallReader:
    """The output text, fed piece by piece, as content and tool calls. What it holds between
    pieces: a possible marker's start, and the call being read."""

    fmt: ToolFormat
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buf: str = ""
    _state: Literal["text", "open", "call", "after"] = "text"
    _skip: str = ""
    _call: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _args_from: int = -1
    _sent: int = 0
    _id: str = ""

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        """What `piece` adds: content text, and tool-call deltas (OpenAI's order)."""
        self._buf += piece
        text: list[str] = []
        deltas: list[CallDelta] = []
        step = {"text": self._text, "open": self._open, "call": self._json, "after": self._after}
        while self._buf and step[self._state](text, deltas):
            pass
        self.content += text
        return "".join(text), deltas

    def finish(self) -> str:
        """The end of the output: what was held back as a possible marker is text."""
        rest = self._buf if self._state == "text" else ""
        self._buf = ""
        self.content.append(rest)
        return rest

    def _text(self, text: list[str], deltas: list[CallDelta]) -> bool:
        trigger = self.fmt.trigger
        if not trigger:  # Llama: the reply is a call when its first character is `{`
            if not any(self.content) and not text and self._buf.lstrip().startswith("{"):
                self._buf = self._buf.lstrip()
                self._state = "call"
                return True
            text.append(self._buf)
            self._buf = ""
            return False
        return self._find(trigger, text.append)

    def _find(self, marker: str, keep: Any) -> bool:
        """Up to `marker` (what is before it to `keep`), then the call's opening; a possible
        start of it at the end is held back."""
        at = self._buf.find(marker)
        if at >= 0:
            keep(self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._state, self._skip = "open", self.fmt.open
            return True
        n = _partial_suffix(self._buf, marker)
        keep(self._buf[: len(self._buf) - n])
        self._buf = self._buf[len(self._buf) - n :]
        return False

    def _open(self, text: list[str], deltas: list[CallDelta]) -> bool:
        n = min(len(self._skip), len(self._buf))
        self._skip, self._buf = self._skip[n:], self._buf[n:]
        if self._skip:
            return False
        self._state = "call"
        return True

    def _after(self, text: list[str], deltas: list[CallDelta]) -> bool:
        """Between calls: the next trigger (Hermes) or the next `{` (Mistral, Llama)."""
        if self.fmt.each:
            return self._find(self.fmt.trigger, lambda dropped: None)
        at = self._buf.find("{")
        if at < 0:
            self._buf = ""
            return False
        self._buf = self._buf[at:]
        self._state = "call"
        return True

    def _json(self, text: list[str], deltas: list[CallDelta]) -> bool:
        for i, ch in enumerate(self._buf):
            if not self._call and ch != "{":
                continue
            self._call += ch
            if self._closes(ch):
                self._buf = self._buf[i + 1 :]
                self._end_call(deltas)
                return True
        self._buf = ""
        self._stream_args(deltas)
        return False

    def _closes(self, ch: str) -> bool:
        """Track the call's JSON; True when its closing brace came."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            return self._depth == 0
        return False

    def _stream_args(self, deltas: list[CallDelta]) -> None:
        """Once the name and the start of the arguments are in: the header delta, then each
        new fragment of the arguments (never the call's own closing brace)."""
        index = len(self.calls)
        if self._args_from < 0:
            key = self.fmt.args_key
            m = re.match(
                r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + key + r'"\s*:\s*', self._call
            )
            if m is None:
                return
            self._args_from = m.end()
            self._id = f"call_{uuid.uuid4().hex[:24]}"
            deltas.append(CallDelta(index, self._id, json.loads(m.group(1)), ""))
        upto = len(self._call) - (1 if self._depth == 0 else 0)
        start = self._args_from + self._sent
        if upto > start:
            self._sent += upto - start
            deltas.append(CallDelta(index, arguments=self._call[start:upto]))

    def _end_call(self, deltas: list[CallDelta]) -> None:
        """The call's JSON is whole: its last argument fragment, and the call."""
        self._stream_args(deltas)
        whole = self._call
        parsed = json.loads(whole)
        self.calls.append(
            {
                "id": self._id,
                "type": "function",
                "function": {
                    "name": parsed["name"],
                    "arguments": whole[self._args_from : len(whole) - 1],
                },
            }
        )
        self._call, self._depth, self._args_from, self._sent = "", 0, -1, 0
        self._state = "after"


def _partial_suffix(text: str, marker: str) -> int:
    """The longest end of `text` that starts `marker` (held back: the next piece may finish it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
