"""The gateway's check of a job's constraint, before the job exists.

A constraint (shared/constraints.py) is compiled into an llguidance grammar and that grammar
built into a matcher over the model's tokenizer, exactly as a worker will build it, and walked
a few steps: whatever fails here is a 400 naming the field and the problem (gateway/
constraint_errors.py words it). What a hostile constraint may cost is bounded before any work
and while it is done:

- size: the constraint's JSON (`GENQ_MAX_CONSTRAINT_BYTES`) and a schema's nesting
  (`GENQ_MAX_CONSTRAINT_DEPTH`) are checked before anything is compiled;
- work: llguidance's own limits (`LIMITS`: lexer fuel, grammar size, lexer states) stop a
  grammar whose lexer or parser would grow without end, with an error the 400 carries;
- emptiness: a grammar must admit some output (its first step allows a token, or it accepts
  the empty output), and a Lark grammar must be able to finish (shared/lark_check.py);
- running: a grammar whose lexer builds but blows up on the first characters of output (a
  regex such as `a{1000}{1000}`: llguidance gives up, over its limits, at the first `a`) is
  found by walking its first `PROBE_STEPS` steps, as a model would, taking the lowest allowed
  token other than EOS each step; a schema's regexes (`pattern`, `patternProperties`), which
  that walk seldom reaches, are built and walked together too, and where that fails each on
  its own, so the 400 names the one at fault (`….properties.code.pattern`). What such a
  walk cannot reach, the worker finds as the output grows, and fails the job with
  `constraint_failed` (never retried elsewhere);
- time: compiling runs off the event loop (`JobService.off_loop`), in threads that release the
  GIL (all but the walk's `consume_token`: microseconds, tens of milliseconds where a lexer
  gives up).

A JSON schema is strict (a keyword the grammar cannot enforce is a 400 naming its path) or
lenient (`strict: false`: the grammar enforces the rest, and the constraint lists what it
leaves out, for the answer's headers and the record; shared/schema_gaps.py).

Checked constraints are cached by their canonical text, strictness and the tokenizer
(`GENQ_CONSTRAINT_CACHE_SIZE` entries): a schema sent again costs a dictionary lookup.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import jsonschema
import llguidance

from gateway.constraint_errors import patterns, reason
from gateway.registry import LoadedCard
from shared.constraints import (
    LIMITS,
    Constraint,
    ConstraintKind,
    canonical,
    grammar_of,
    llg_error,
    llg_tokenizer,
    ref_loop,
)
from shared.errors import BadRequest
from shared.lark_check import unfinishable
from shared.schema_gaps import SchemaPlan, dotted, keyword_of, plan_schema
from shared.schemas import Sampling, json_depth
from shared.settings import GatewaySettings

T = TypeVar("T")
OffLoop = Callable[[Callable[[], T], int | None], Awaitable[T]]

TOKENIZERS_KEPT = 8
"""llguidance tokenizers kept per gateway process (one per model tokenizer in use)."""
PROBE_STEPS = 8
"""Most steps of a grammar the check walks (a lexer that blows up does so on its first
characters; each step is one mask, tens of microseconds for an ordinary grammar)."""
PROBE_BUDGET_S = 0.05
"""The walk takes no further step once it has run this long: a grammar whose every mask is
slow (`a{100000}`, a tenth of a second a mask) costs the check a step or two, not eight."""
LEXER_LIMIT = "lexer error"
"""How llguidance's message starts where its lexer hit a limit (fuel, states) computing a mask
(a mask that finds no token for an empty language fails otherwise)."""
PATTERNS_CHECKED = 64
"""Most distinct regexes of one schema checked apart from the schema (past them, only the
whole schema's walk and the worker can find a regex that cannot run)."""


class ConstraintChecker:
    """Checks constraints for one gateway process; caches what it checked."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._tokenizers: OrderedDict[str, llguidance.LLTokenizer] = OrderedDict()
        self._checked: OrderedDict[str, tuple[str, list[str]]] = OrderedDict()
        """Hash of (tokenizer, strictness, canonical constraint) → its grammar and what that
        leaves out, most recently used last."""
        self._plans: OrderedDict[str, SchemaPlan] = OrderedDict()
        """Hash of (strictness, canonical schema) → its plan (`plan`), most recently used last."""
        self.hits = 0
        self.misses = 0

    async def check(
        self,
        loaded: LoadedCard,
        kind: ConstraintKind,
        value: Any,
        param: str,
        off_loop: OffLoop[Any],
        origin: str | None = None,
        strict: bool = True,
    ) -> Constraint:
        """The constraint the job record keeps, its grammar checked against `loaded`'s
        tokenizer; BadRequest (400, naming `param`) for one that cannot run. A JSON schema
        not `strict` is enforced where the grammar can (shared/schema_gaps.py) and the rest is
        listed in the constraint's `unenforced`; a strict one with a keyword the grammar
        cannot enforce is a 400 naming the keyword's path."""
        text = canonical(kind, value)
        self._check_size(kind, value, text, param)
        lenient = kind == "json_schema" and not strict
        mode = "lenient" if lenient else "strict"
        key = hashlib.sha256(f"{loaded.card.tokenizer_sha}\0{mode}\0{text}".encode()).hexdigest()
        kept = self._checked.get(key)
        if kept is not None:
            self._checked.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
            kept = await self._checked_grammar(
                loaded, kind, value, param, off_loop, lenient, origin
            )
            self._checked[key] = kept
            while len(self._checked) > self.settings.constraint_cache_size:
                self._checked.popitem(last=False)
        grammar, unenforced = kept
        return Constraint(
            type=kind,
            value=value,
            grammar=grammar,
            origin=origin,
            strict=not lenient,
            unenforced=[dotted(p, param) for p in unenforced],
        )

    async def plan(
        self, schema: dict[str, Any], strict: bool, param: str, off_loop: OffLoop[Any]
    ) -> SchemaPlan:
        """A JSON schema that is part of a larger grammar (a tool's parameters, a response
        format beside tools): what its grammar is made from and what it leaves out (cached);
        a 400 naming the keyword for a strict one the grammar cannot enforce."""
        key = hashlib.sha256(f"{strict}\0{canonical('json_schema', schema)}".encode()).hexdigest()
        planned = self._plans.get(key)
        if planned is None:
            planned = await off_loop(lambda: plan_schema(schema, strict), None)
            self._plans[key] = planned
            while len(self._plans) > self.settings.constraint_cache_size:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        if planned.gap is not None:
            raise _unenforceable(param, planned.gap)
        return planned

    async def _checked_grammar(
        self,
        loaded: LoadedCard,
        kind: ConstraintKind,
        value: Any,
        param: str,
        off_loop: OffLoop[Any],
        lenient: bool,
        origin: str | None,
    ) -> tuple[str, list[str]]:
        """The grammar, compiled and checked, and the paths of what it leaves out."""
        tokenizer = await self._tokenizer(loaded, off_loop)
        made = origin is not None and origin != "response_format"  # a grammar genq wrote
        if not lenient:
            try:
                return await off_loop(
                    lambda: _compile(tokenizer, kind, value, param, made), None
                ), []
            except BadRequest:
                if kind != "json_schema" or not isinstance(value, dict):
                    raise
                gap = (await off_loop(lambda: plan_schema(value, True), None)).gap
                if gap is None:
                    raise
                raise _unenforceable(param, gap) from None
        if _broken(value):  # not a schema at all: what llguidance says of it strictly is the 400
            await off_loop(lambda: _compile(tokenizer, kind, value, param, made), None)
        planned = await off_loop(lambda: plan_schema(value, False), None)
        grammar = await off_loop(
            lambda: _compile(tokenizer, kind, planned.schema, param, made, lenient=True), None
        )
        return grammar, planned.unenforced

    def _check_size(self, kind: ConstraintKind, value: Any, text: str, param: str) -> None:
        s = self.settings
        size = len(text.encode())
        if size > s.max_constraint_bytes:
            raise BadRequest(
                f"{param} is {size} bytes; the limit (GENQ_MAX_CONSTRAINT_BYTES) is "
                f"{s.max_constraint_bytes}",
                param=param,
                code="constraint_too_large",
            )
        if kind == "json_schema":
            depth = json_depth(value)
            if depth > s.max_constraint_depth:
                raise BadRequest(
                    f"{param} nests {depth} levels deep; the limit (GENQ_MAX_CONSTRAINT_DEPTH) "
                    f"is {s.max_constraint_depth}",
                    param=param,
                    code="constraint_too_deep",
                )

    async def _tokenizer(self, loaded: LoadedCard, off_loop: OffLoop[Any]) -> Any:
        sha = loaded.card.tokenizer_sha
        tok = self._tokenizers.get(sha)
        if tok is None:
            card = loaded.card
            raw = loaded.tokenizer.to_str()
            tok = await off_loop(lambda: llg_tokenizer(raw, card.eos_token_ids), None)
            self._tokenizers[sha] = tok
            while len(self._tokenizers) > TOKENIZERS_KEPT:
                self._tokenizers.popitem(last=False)
        self._tokenizers.move_to_end(sha)
        return tok


def _compile(
    tokenizer: Any,
    kind: ConstraintKind,
    value: Any,
    param: str,
    made: bool = False,
    lenient: bool = False,
) -> str:
    """The constraint's grammar, built into a matcher as a worker will build it and walked a
    few steps; BadRequest for what cannot run. `made`: a grammar genq wrote from the request
    (tool calls), whose lines and columns mean nothing to the client. `lenient`: a JSON
    schema's unimplemented keywords are left out."""
    what = "the grammar genq makes of them" if made else f"this {_WHAT[kind]}"
    try:
        grammar = grammar_of(kind, value, lenient)
    except ValueError as exc:
        raise _invalid(param, what, reason(kind, str(exc), not made)) from None
    if kind == "grammar":
        why = unfinishable(value)
        if why is not None:
            raise _invalid(param, what, why)
    if kind == "json_schema":
        loop = ref_loop(value)
        if loop is not None:
            raise _invalid(param, what, f"its $ref {loop!r} leads back to itself (no value ends)")
        _check_patterns(tokenizer, value, param)
    why = _fault(tokenizer, grammar, kind, not made)
    if why is not None:
        raise _invalid(param, what, why)
    return grammar


def _check_patterns(tokenizer: Any, schema: Any, param: str) -> None:
    """A schema's regexes, built and walked together as JSON strings (the walk of the whole
    schema reaches only the first of them); where that fails, each alone: BadRequest naming
    the first that cannot run, at its path in the schema."""
    paths: dict[str, str] = {}
    for path, pattern in patterns(schema):
        if len(paths) == PATTERNS_CHECKED:
            break
        paths.setdefault(pattern, path)
    if not paths:
        return
    every = grammar_of("json_schema", {"anyOf": [_string(p) for p in paths]})
    why = _fault(tokenizer, every, "regex")
    if why is None:
        return
    if len(paths) == 1:
        raise _invalid(f"{param}.{next(iter(paths.values()))}", "this regex", why)
    for pattern, path in paths.items():  # which one (a second build of the one at fault)
        why = _fault(tokenizer, grammar_of("json_schema", _string(pattern)), "regex")
        if why is not None:
            raise _invalid(f"{param}.{path}", "this regex", why)


def _string(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern}


def _fault(
    tokenizer: Any, grammar: str, kind: ConstraintKind, positions: bool = True
) -> str | None:
    """Why `grammar` cannot run, found by building its matcher and walking its first
    `PROBE_STEPS` steps (the lowest allowed token other than EOS each step; the first two
    always, the rest within `PROBE_BUDGET_S`); None if nothing went wrong there. `positions`:
    say where in the grammar (see `reason`)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        return reason(kind, matcher.get_error(), positions)
    until = time.monotonic() + PROBE_BUDGET_S
    for step in range(PROBE_STEPS):
        if step > 1 and time.monotonic() > until:
            return None
        bits = bytearray(matcher.compute_bitmask())
        for eos in tokenizer.eos_tokens:
            if eos // 8 < len(bits):
                bits[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
        token = _lowest(bits)
        if token is None:  # the end, no output at all, or a mask that failed (EOS alone)
            error = llg_error(matcher.get_error()) if matcher.is_error() else ""
            if error.startswith(LEXER_LIMIT) or (error and step > 0):
                return _gave_up(error)
            if step == 0 and not matcher.is_accepting():
                return "it admits no output at all (nothing can be generated)"
            return None
        if not matcher.consume_token(token) or matcher.is_error():
            return _gave_up(llg_error(matcher.get_error()))
    return None


def _lowest(bits: bytes | bytearray) -> int | None:
    """The lowest token id set in a mask (bit i of byte i // 8), or None."""
    rest = bytes(bits).lstrip(b"\0")
    if not rest:
        return None
    low = rest[0] & -rest[0]
    return (len(bits) - len(rest)) * 8 + low.bit_length() - 1


def _gave_up(error: str) -> str:
    return (
        f"llguidance gives up on the first tokens of output ({error}): it grows past the limits "
        "on what a constraint may cost"
    )


_WHAT: dict[ConstraintKind, str] = {
    "json_schema": "JSON schema",
    "regex": "regex",
    "grammar": "grammar",
}


def _invalid(param: str, what: str, why: str) -> BadRequest:
    return BadRequest(
        f"{param}: {what} cannot be used: {why}", param=param, code="invalid_constraint"
    )


def _broken(schema: Any) -> bool:
    """Whether a JSON schema breaks its own meta-schema (`{"type": "objekt"}`, a `pattern`
    that is no regex): leniency leaves out what the grammar cannot enforce, never a mistake."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return True
    return False


def _unenforceable(param: str, gap: str) -> BadRequest:
    """A strict schema with a keyword the grammar cannot enforce: the 400 names where it is."""
    where = dotted(gap, param)
    keyword = keyword_of(where)
    return BadRequest(
        f"{where}: `{keyword}` cannot be enforced while generating (genq's grammar does not "
        "implement it), and a strict schema is refused rather than enforced in part; with "
        "strict: false (natively json_schema_strict: false) genq enforces the rest and checks "
        "the finished output against the whole schema",
        param=where,
        code="unenforceable_schema",
    )


def check_compatible(sampling: Sampling, param: str) -> None:
    """A 400 for sampler settings a constrained job cannot take: `banned_strings` (the
    engines back off over tokens the grammar has already taken) and `min_tokens` (it would
    hold back the EOS a complete grammar allows alone)."""
    for name in ("banned_strings", "min_tokens"):
        if getattr(sampling, name):
            raise BadRequest(
                f"{name} cannot be combined with a constraint ({param}): the grammar decides "
                "what may come next and where the output ends",
                param=name,
            )
