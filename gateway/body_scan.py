"""A body's long lists counted before it is parsed, from a msgspec scan that keeps each item as
raw bytes: `messages` over its limit (7 MB of 200,000 messages: ~20 ms, where `json.loads` and
pydantic took ~250 ms of the event loop on a 2-core box), and a prompt of token ids that leaves
its model no room (14 MB of 5,000,000 ids: refused in milliseconds, not after seconds of
parsing, validating each id and checking it against the vocabulary).

The limits are the body model's own (`Field(max_length=…)` on a top-level list) and the
model's context, and the refusal says what the full check would, so the answer is the same
either way; a body the scan cannot read (not JSON, a list that is not a list, a model not
served) goes on to the full parse, which reports it as it always has. Used by the OpenAI and
the native job routes (`CountedListsRoute`) and a batch file's lines (`Counter`).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import annotated_types
import msgspec
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from redis.exceptions import RedisError

from gateway.job_service import no_room
from shared.errors import BadRequest, GenqError

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
_UTF8 = frozenset({"utf-8", "utf-8-sig"})


@dataclass(frozen=True, slots=True)
class TooLong:
    """A list over its limit, in pydantic's words."""

    field: str
    limit: int
    count: int

    @property
    def message(self) -> str:
        return f"List should have at most {self.limit} items after validation, not {self.count}"


class Counter:
    """Counts the top-level lists of `model`'s bodies that have a `max_length`."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.limits = list_limits(model)
        shape = msgspec.defstruct(
            "CountedLists", [(name, list[msgspec.Raw] | None, None) for name in self.limits]
        )
        self._decoder = msgspec.json.Decoder(shape)

    def first_too_long(self, raw: bytes) -> TooLong | None:
        if not self.limits:
            return None
        try:
            counted = self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None  # the full parse reports it, as for any other body
        for name, limit in self.limits.items():
            items = getattr(counted, name)
            if items is not None and len(items) > limit:
                return TooLong(name, limit, len(items))
        return None


class _PromptIds(msgspec.Struct):
    """The parts of a body a prompt's length in token ids is read from (each value skipped
    over as raw bytes, its JSON checked)."""

    model: str | None = None
    input_ids: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


_PROMPT_IDS = msgspec.json.Decoder(_PromptIds)
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
PROMPT_ID_FIELDS = frozenset({"input_ids", "prompt"})
"""The fields a prompt of token ids comes in: the native API's, the OpenAI completions'."""
MAX_SCANNED_PROMPTS = 1024
"""Past this many prompts of ids in one body the scan leaves the counting to the full check."""


def longest_prompt(raw: bytes) -> tuple[str, int] | None:
    """The model a body names and its longest prompt of token ids (`input_ids`; a `prompt`
    of ids, or of lists of ids); None where it holds none or the scan cannot judge it."""
    try:
        body = _PROMPT_IDS.decode(raw)
        prompt = bytes(body.prompt)
        lengths = [n for n in (_ids_in(bytes(body.input_ids)), _ids_in(prompt)) if n]
        if prompt.startswith(b"[[") and prompt.count(b"[") <= MAX_SCANNED_PROMPTS + 1:
            lengths += [n for item in _RAW_LIST.decode(prompt) if (n := _ids_in(bytes(item)))]
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if not body.model or not lengths:
        return None
    return body.model, max(lengths)


def _ids_in(value: bytes) -> int | None:
    """How many items a JSON array of numbers holds, from its commas (the scan checked its
    syntax, so each separates two); None for any other value."""
    if not value.startswith(b"[") or value.count(b"[") != 1 or b'"' in value or b"{" in value:
        return None
    if commas := value.count(b","):
        return commas + 1
    return 1 if value[1:-1].strip() else 0  # one item or none: no copy of a long array


async def check_room(request: Request, raw: bytes) -> None:
    """The 400 a prompt of token ids gets when it leaves its model no room, before the body
    is parsed; anything else (no such model, Redis away) is the full check's to report."""
    found = longest_prompt(raw)
    if found is None:
        return
    model, tokens = found
    try:
        loaded = await request.app.state.genq.registry.get(model)
    except (GenqError, RedisError, OSError):
        return
    context = loaded.card.max_seq_len
    if tokens >= context:
        raise no_room(tokens, context)


def list_limits(model: type[BaseModel]) -> dict[str, int]:
    """Each top-level list field of `model` with a `max_length`, by its JSON name."""
    limits = {}
    for name, field in model.model_fields.items():
        if typing.get_origin(field.annotation) is not list:
            continue
        for m in field.metadata:
            if isinstance(m, annotated_types.MaxLen):
                limits[field.alias or name] = m.max_length
    return limits


def refuse_other_encodings(raw: bytes) -> None:
    """A JSON body must be UTF-8 (RFC 8259 §8.1), as the README says. `json.loads`, which
    FastAPI parses with, would also read UTF-16 and UTF-32 (it guesses from the first bytes);
    those are refused here so that what is accepted is what is documented. A UTF-8 byte order
    mark is tolerated, as the RFC allows a parser to."""
    encoding = json.detect_encoding(raw[:4])
    if encoding not in _UTF8:
        name = encoding.upper()
        message = f"the body is not UTF-8 (it reads as {name}); send JSON encoded as UTF-8"
        raise BadRequest(message, param="body")


class CountedListsRoute(APIRoute):
    """A route whose JSON body has its long lists counted before FastAPI parses it: one over
    its limit is pydantic's 422, a prompt of token ids with no room in its model the 400 the
    job's own check gives. Its body must be UTF-8 (`refuse_other_encodings`)."""

    def get_route_handler(self) -> Handler:
        handler: Handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler
        counter = Counter(model)
        ids = bool(PROMPT_ID_FIELDS & set(model.model_fields))

        async def counted(request: Request) -> Response:
            raw = await request.body()
            refuse_other_encodings(raw)
            if (over := counter.first_too_long(raw)) is not None:
                ctx = {"field_type": "List", "max_length": over.limit}
                error = {"type": "too_long", "loc": ("body", over.field), "msg": over.message}
                raise RequestValidationError([{**error, "ctx": ctx}])
            if ids:
                await check_room(request, raw)
            return await handler(request)

        return counted
