"""OpenAI's `response_format` as a genq constraint (shared/constraints.py).

    {"type": "text"}                                  no constraint
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}

The shape is checked here (a 400 naming the field, as OpenAI's does); the schema itself is
compiled and checked by the gateway's `ConstraintChecker`, as a native `json_schema` is, with
`param` naming where it came from. `strict` (OpenAI's default: false) decides what happens to
a keyword the grammar cannot enforce (`not`, `uniqueItems`, …): strict, a 400 naming its
path; not strict, the rest of the schema is enforced, the keyword is named in the answer and
the finished output is checked against the whole schema (shared/schema_gaps.py). genq takes
the schema as written either way (OpenAI's strict mode also requires every property and no
extra ones). `json_object` is a schema the grammar enforces whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared.errors import BadRequest

JSON_OBJECT: dict[str, Any] = {"type": "object"}
"""`json_object`: any JSON object (llguidance: properties free, any value)."""
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a response format's (and a function's) name."""
_FORMAT_FIELDS = frozenset({"name", "schema", "strict", "description"})


@dataclass(frozen=True, slots=True)
class AskedSchema:
    """The JSON schema a `response_format` asks for."""

    schema: dict[str, Any]
    param: str
    """The field it came from (`param` of a 400 about it, and its paths' start)."""
    strict: bool


def response_schema(fmt: dict[str, Any] | None) -> AskedSchema | None:
    """The JSON schema a `response_format` asks for; None for text. BadRequest for a shape
    OpenAI would refuse."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return AskedSchema(JSON_OBJECT, "response_format", strict=True)
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
    strict = spec.get("strict") is True  # absent or null: OpenAI's default, not strict
    return AskedSchema(schema, "response_format.json_schema.schema", strict)
