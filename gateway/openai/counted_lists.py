"""A body's long lists counted before it is parsed: `messages` over its limit is refused from a
msgspec scan that keeps each item as raw bytes (7 MB of 200,000 messages: ~20 ms), not after
`json.loads` and pydantic built them all (~250 ms of the event loop on a 2-core box).

The limits are the body model's own (`Field(max_length=…)` on a top-level list), and the
refusal says what pydantic would, so the answer is the same either way; a body the scan cannot
read (not JSON, a list that is not a list) goes on to the full parse, which reports it as it
always has. Used by the OpenAI routes (`CountedListsRoute`) and a batch file's lines.
"""

from __future__ import annotations

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

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


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
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # the full parse reports it, as for any other body
        for name, limit in self.limits.items():
            items = getattr(counted, name)
            if items is not None and len(items) > limit:
                return TooLong(name, limit, len(items))
        return None


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


class CountedListsRoute(APIRoute):
    """A route whose JSON body has its long lists counted before FastAPI parses it; one over
    its limit is pydantic's 422."""

    def get_route_handler(self) -> Handler:
        handler: Handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler
        counter = Counter(model)
        if not counter.limits:
            return handler

        async def counted(request: Request) -> Response:
            if (over := counter.first_too_long(await request.body())) is not None:
                ctx = {"field_type": "List", "max_length": over.limit}
                error = {"type": "too_long", "loc": ("body", over.field), "msg": over.message}
                raise RequestValidationError([{**error, "ctx": ctx}])
            return await handler(request)

        return counted
