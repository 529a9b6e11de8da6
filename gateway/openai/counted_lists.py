"""A body's long lists counted before it is parsed: `messages` over its limit is refused from a
msgspec scan that keeps each item as raw bytes (7 MB of 200,000 messages: ~20 ms), not after
`json.loads` and pydantic built them all (~250 ms of the event loop on a 2-core box).

The limits are the body model's own (`Field(max_length=…)` on a top-level list), and the 422 is
the one pydantic would give, so the answer is the same either way; a body the scan cannot read
(not JSON, a list that is not a list) goes on to FastAPI, which reports it as it always has.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Coroutine
from typing import Any

import annotated_types
import msgspec
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


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


def scanner(limits: dict[str, int]) -> msgspec.json.Decoder[Any]:
    """A decoder that reads only the named lists, each item left as raw bytes."""
    fields = [(name, list[msgspec.Raw] | None, None) for name in limits]
    shape = msgspec.defstruct("CountedLists", fields, forbid_unknown_fields=False)
    return msgspec.json.Decoder(shape)


def too_long(body: bytes, limits: dict[str, int], decoder: msgspec.json.Decoder[Any]) -> None:
    """Raise pydantic's own 422 for the first list in `body` over its limit."""
    try:
        counted = decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # FastAPI's parse and pydantic report it, as for any other body
    for name, limit in limits.items():
        items = getattr(counted, name)
        if items is not None and len(items) > limit:
            raise RequestValidationError(
                [
                    {
                        "type": "too_long",
                        "loc": ("body", name),
                        "msg": f"List should have at most {limit} items after validation, "
                        f"not {len(items)}",
                        "ctx": {"field_type": "List", "max_length": limit},
                    }
                ]
            )


class CountedListsRoute(APIRoute):
    """A route whose JSON body has its long lists counted before FastAPI parses it."""

    def get_route_handler(self) -> Handler:
        handler: Handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler
        limits = list_limits(model)
        if not limits:
            return handler
        decoder = scanner(limits)

        async def counted(request: Request) -> Response:
            too_long(await request.body(), limits, decoder)
            return await handler(request)

        return counted
