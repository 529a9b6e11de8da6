"""Constrained generation: what a job's constraint is, and the one grammar every engine runs.

A job may carry one constraint (`JobSpec.constraint`): a JSON schema, a regex or a Lark
grammar, given on the native API as `json_schema`, `regex` or `grammar`; OpenAI's
`response_format` and `tools` become one of them (gateway/openai/structured.py). The gateway
turns it into an llguidance grammar (`grammar_of`), checks that grammar against the model's
tokenizer before the job exists (gateway/constraints.py), and stores both: the constraint as
given (shown by `GET /v1/jobs/{id}`) and the grammar the worker runs. The worker never
compiles anything else: its engine builds an `LLMatcher` from the stored grammar
(worker/constraint.py), replays the tokens an earlier attempt generated, and masks each step.

llguidance is the one token-mask library: the same grammar text and the same matcher in the
gateway's checks, the `sim` engine and both GPU engines, on the CPU (masks are computed by its
Rust code, in threads that release the GIL).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json_schema", "regex", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json_schema", "regex", "grammar")
"""The native API's constraint fields, in the order they are documented: one at most."""
CONSTRAINT_FAILED = "constraint_failed"
"""The error code of a job whose constraint could not run on the worker (the matcher failed
as the output grew, a replay did not fit it, its grammar did not build there). That is the
request's fault, not the worker's: the job fails at once, is never tried again elsewhere, and
the OpenAI APIs answer it as an `invalid_request_error` naming the field."""

JSON_COMPILE_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "lenient": False}
"""How a JSON schema is compiled: compact JSON (`{"a":1}`, no whitespace between tokens: a
model cannot waste its tokens on blank lines), and a schema keyword llguidance does not
implement is an error (a strict schema's 400 names it) rather than silently ignored."""


def json_options(lenient: bool) -> JsonCompileOptions:
    """The compile options a schema is held to whatever its own `x-guidance` says (given as
    llguidance's overrides): leniency is genq's decision (`strict`), never the schema's.
    Lenient: a keyword llguidance does not implement is left out of the grammar (a warning,
    shared/schema_gaps.py names it) instead of failing the compile."""
    return {**JSON_COMPILE_OPTIONS, "lenient": lenient}


LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=2_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)
"""What one grammar may cost llguidance (its defaults, some lower; a bigger grammar is a
400). `verbose_errors` off: an error message does not echo the grammar back."""


class Constraint(BaseModel):
    """A job's constraint, as the job record keeps it."""

    model_config = ConfigDict(extra="forbid")

    type: ConstraintKind
    value: Any
    """The JSON schema (an object), the regex or the Lark grammar (text), as given."""
    grammar: str
    """The llguidance grammar the worker runs (made by `grammar_of`; checked by the gateway)."""
    origin: str | None = None
    """What made it, when not the native field itself: `response_format` (json_object or
    json_schema) or `tools` (a tool-call grammar)."""
    strict: bool = True
    """A JSON schema held to all of its keywords (what the grammar cannot enforce was a 400),
    or not (`strict: false`: enforced where the grammar can, the rest listed in
    `unenforced` and checked when the job ends)."""
    unenforced: list[str] = Field(default_factory=list)
    """Where the grammar does not hold the output to the schema: paths to keywords, as the
    request named them (`response_format.json_schema.schema.properties.tags.uniqueItems`)."""
    answer_schema: dict[str, Any] | None = None
    """Beside tools: the `response_format` schema a reply that is not tool calls is JSON of
    (a `json_schema` constraint's schema is its `value`)."""
    calls_start: str | None = None
    """Beside `answer_schema`: what a reply of tool calls starts with (it is not checked
    against the schema)."""

    def output_schema(self) -> dict[str, Any] | None:
        """The schema the finished output is checked against, if any."""
        if self.type == "json_schema" and isinstance(self.value, dict):
            return self.value
        return self.answer_schema

    @property
    def field(self) -> str:
        """The request field it came from: the native field, `response_format` or `tools`."""
        return self.origin.partition(":")[0] if self.origin else self.type

    def shown(self) -> dict[str, Any]:
        """As `GET /v1/jobs/{id}` shows it: the type and the value, not the compiled grammar;
        for a JSON schema, whether it is strict and what the grammar does not enforce."""
        out: dict[str, Any] = {"type": self.type, self.type: self.value}
        if self.origin is not None:
            out["origin"] = self.origin
        if self.answer_schema is not None:
            out["response_format"] = self.answer_schema
        if self.output_schema() is not None:
            out["strict"] = self.strict
        if self.output_schema() is not None or self.unenforced:
            out["unenforced"] = self.unenforced
        return out


class SchemaCheck(BaseModel):
    """How a finished output stands against the job's JSON schema (checked by the worker when
    the job ends)."""

    model_config = ConfigDict(extra="forbid")

    valid: bool | None
    """Whether the output is valid under the whole schema; None where it was not checked (a
    reply of tool calls, a schema the validator cannot use: `errors` says why)."""
    errors: list[str] = Field(default_factory=list)
    """The first violations (`path: message`), or why it was not checked."""


def grammar_of(kind: ConstraintKind, value: Any, lenient: bool = False) -> str:
    """The llguidance grammar for a constraint (not yet checked: `LLMatcher` does that);
    `lenient`: a JSON schema's keywords llguidance does not implement are left out.
    ValueError for a value that is not even of the right shape."""
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise ValueError("a JSON schema is an object")
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                value, JSON_COMPILE_OPTIONS, json_options(lenient)
            )
        )
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} is a non-empty string")
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(value))
    return str(llguidance.LLMatcher.grammar_from_lark(value))


def llg_error(error: str) -> str:
    """llguidance's error message on one line, without the marker it adds where
    `verbose_errors` is off."""
    lines = [line.strip() for line in error.splitlines()]
    return "; ".join(line for line in lines if line and line != "<non-verbose/>")


def canonical(kind: str, value: Any) -> str:
    """A constraint's identity for caches: equal for equal constraints whatever their key
    order."""
    return json.dumps([kind, value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def llg_tokenizer(
    tokenizer_json: str, eos_ids: list[int], vocab_size: int | None = None
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a model's tokenizer.json; `vocab_size`: the model's logits'
    width when it is more than the tokenizer's (the extra ids are never allowed)."""
    eos: int | list[int] | None = list(eos_ids) or None
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)


def ref_loop(schema: Any) -> str | None:
    """A `$ref` that leads back to itself without the output moving on (`{"$ref": "#"}`, or
    `a` → `b` → `a` through `$ref` and `allOf`, or `anyOf`/`oneOf` whose every member loops),
    or None. A schema that recurses through `properties` or `items` (a tree) is fine: each
    turn consumes output; so is an `anyOf` with one member that ends. llguidance accepts such a
    loop (as no constraint at all); genq refuses it (a 400) before the job exists."""
    if not isinstance(schema, dict):
        return None
    done: dict[str, bool] = {}
    on_path: list[str] = []
    looped: list[str] = []

    def ends(pointer: str) -> bool:
        if pointer in on_path:
            looped.append(pointer)
            return False
        if pointer in done:
            return done[pointer]
        on_path.append(pointer)
        node = resolve_pointer(schema, pointer)
        ok = True
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                ok = ends(ref)
            ok = ok and all(ends(p) for p in _members(node, pointer, "allOf"))
            for key in ("anyOf", "oneOf"):
                members = _members(node, pointer, key)
                if members:  # every member is tried: one that ends is enough
                    ok = [ends(p) for p in members].count(True) > 0 and ok
        on_path.pop()
        done[pointer] = ok
        return ok

    return None if ends("#") else (looped[0] if looped else "#")


def _members(node: dict[str, Any], pointer: str, key: str) -> list[str]:
    members = node.get(key)
    if not isinstance(members, list):
        return []
    return [f"{pointer.rstrip('/')}/{key}/{i}" for i in range(len(members))]


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The node a local JSON pointer (`#`, `#/$defs/a`) names, or None."""
    node = root
    for part in pointer.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
