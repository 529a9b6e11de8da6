"""OpenAI's `response_format` as a genq constraint (shared/constraints.py).

    {"type": "text"}                                  no constraint
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}

The shape is checked here (a 400 naming the field, as OpenAI's does); the schema itself is
compiled and checked by the gateway's `ConstraintChecker`, as a native `json_schema` is, with
`param` naming where it came from. `strict` changes nothing: genq always holds the output to
the whole schema (OpenAI's strict mode also requires every property and no extra ones; genq
takes the schema as written).
"""

from __future__ import annotations

import re
from typing import Any

from shared.errors import BadRequest

JSON_OBJECT: dict[str, Any] = {"type": "object"}
"""`json_object`: any JSON object (llguidance: properties free, any value)."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a response format's (and a function's) name."""
_FORMAT_FIELDS = frozenset({"name", "schema", "strict", "description"})


def response_schema(fmt: dict[str, Any] | None) -> tuple[dict[str, Any], str] | None:
    """The JSON schema a `response_format` asks for and the field it came from (`param` of a
    400 about it); None for text. BadRequest for a shape OpenAI would refuse."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT, "response_format"
    if kind != "json_schema":
        raise BadRequest(
            f"response_format.type is {kind!r}; allowed: 'text', 'json_object', 'json_schema'",
            param="response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest(
            "response_format.json_schema is required with type 'json_schema': "
            '{"name": …, "schema": {…}}',
            param="response_format.json_schema",
        )
    unknown = sorted(set(spec) - _FORMAT_FIELDS)
    if unknown:
        raise BadRequest(
            f"response_format.json_schema has unknown fields {unknown}; allowed: "
            f"{sorted(_FORMAT_FIELDS)}",
            param="response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            param="response_format.json_schema.name",
        )
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise BadRequest(
            "response_format.json_schema.strict must be a boolean",
            param="response_format.json_schema.strict",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest(
            "response_format.json_schema.schema must be a JSON schema (an object)",
            param="response_format.json_schema.schema",
        )
    return schema, "response_format.json_schema.schema"
