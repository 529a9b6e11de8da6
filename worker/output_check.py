"""A finished output checked against its job's JSON schema (`Constraint.output_schema`).

The grammar holds the output to what llguidance enforces; a schema sent with `strict: false`
may have keywords it does not (`uniqueItems`, `not`, …: shared/schema_gaps.py), so the worker
checks every output under a JSON schema against the whole schema when the job ends, with the
`jsonschema` library and the schema's own draft (`$schema`; 2020-12 when it names none), its
formats checked where the library knows them. It is done here, where the whole text of every
job is at hand whichever API asked for it (streamed or not, native, OpenAI, a batch line); the
result goes out in the job's `done` event and its record (`SchemaCheck`).

A reply of tool calls (beside a response format) is not checked against the format's schema.
Validators are built once per schema and kept (`Validators`, an LRU). A check runs in a thread
of its own, off the worker's event loop (building a large schema's validator takes tens of
milliseconds); the job's end is written when it is done.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from shared.constraints import Constraint, SchemaCheck

VALIDATORS_KEPT = 256
"""Schemas a worker keeps a validator for (one per schema however many jobs use it)."""
ERRORS_KEPT = 3
"""Violations a check reports (the first, in the validator's order)."""
ERROR_CHARS = 300
"""The most of one violation's message kept (jsonschema quotes the offending value)."""


class Validators:
    """A worker's validators, by schema, most recently used last; checks run one at a time in
    a thread of their own (`check_off_loop`), so that the worker's event loop goes on."""

    def __init__(self, kept: int = VALIDATORS_KEPT) -> None:
        self._kept = kept
        self._validators: OrderedDict[str, Validator | str] = OrderedDict()
        """Schema hash → its validator, or why none could be built."""
        self._thread: ThreadPoolExecutor | None = None

    @staticmethod
    def wanted(constraint: Constraint | None) -> bool:
        """Whether a job under `constraint` has its output checked."""
        return constraint is not None and constraint.output_schema() is not None

    async def check_off_loop(self, constraint: Constraint | None, text: str) -> SchemaCheck | None:
        """`check`, in the validators' thread."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="genq-schema-check")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.check, constraint, text)

    def check(self, constraint: Constraint | None, text: str) -> SchemaCheck | None:
        """How `text` stands against the job's schema; None for a job without one."""
        schema = constraint.output_schema() if constraint is not None else None
        if schema is None or constraint is None:
            return None
        if constraint.calls_start and text.lstrip().startswith(constraint.calls_start):
            return SchemaCheck(valid=None, errors=["the reply is tool calls, not the schema's"])
        validator = self._validator(schema)
        if isinstance(validator, str):
            return SchemaCheck(valid=None, errors=[validator])
        try:
            instance = json.loads(text)
        except ValueError as exc:
            return SchemaCheck(valid=False, errors=[_cut(f"the output is not JSON: {exc}")])
        try:
            found = list(itertools.islice(validator.iter_errors(instance), ERRORS_KEPT))
        except Exception as exc:  # a schema the validator trips on is reported
            return SchemaCheck(valid=None, errors=[_cut(f"the schema could not be used: {exc}")])
        return SchemaCheck(valid=not found, errors=[_cut(_shown(e)) for e in found])

    def _validator(self, schema: dict[str, Any]) -> Validator | str:
        key = hashlib.sha256(json.dumps(schema).encode()).hexdigest()
        validator = self._validators.get(key)
        if validator is None:
            validator = _build(schema)
            self._validators[key] = validator
            while len(self._validators) > self._kept:
                self._validators.popitem(last=False)
        self._validators.move_to_end(key)
        return validator


def _build(schema: dict[str, Any]) -> Validator | str:
    """The validator of `schema`'s own draft, with its format checker; or why there is none."""
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema, format_checker=cls.FORMAT_CHECKER)
    except jsonschema.SchemaError as exc:
        return _cut(f"the schema is not valid under its draft: {exc.message}")
    except Exception as exc:  # never let a schema fail the job's end
        return _cut(f"the schema could not be used: {exc}")


def _shown(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.absolute_path)
    return f"{where or '(root)'}: {error.message}"


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"
