"""What of a JSON schema the grammar cannot enforce, and where it is.

llguidance implements most of JSON Schema; a keyword it does not (`not`, `uniqueItems`,
`dependentRequired`, `if`/`then`, an unknown `format`, …) fails the compile, or, compiled
leniently, is left out of the grammar with a warning that names the keyword but not where it
is. `plan_schema` turns that into what a request needs:

- strict (`strict: true`, the native default): the first such keyword, with its path
  (`properties.tags.uniqueItems`), for a 400 that names it;
- lenient (`strict: false`, OpenAI's default): the paths of every keyword the grammar leaves
  out, for the answer and the job record (the worker validates the output against the whole
  schema when the job ends). A schema llguidance cannot compile even leniently is relaxed,
  a part at a time, where its error names the part (a regex it cannot run, pattern
  properties that overlap, a recursive `$ref` beside other keywords, a `$ref` to another
  document): that part is left out and listed too, so the job runs.

Paths follow the keywords llguidance compiles from the root (`properties`, `items`, `anyOf`,
…), through local `$ref`s to where the referenced schema is written (`$defs.Tag.uniqueItems`).
Nothing here needs a tokenizer: the gateway checks the grammar against one afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import llguidance

from shared.constraints import JSON_COMPILE_OPTIONS, LIMITS, json_options, resolve_pointer

Path = tuple[str, ...]

MAX_RELAXATIONS = 16
"""Parts of a lenient schema that may be left out, one compile each, before the schema is
refused as it is (each compile of a large schema costs milliseconds)."""
UNENFORCED_KEPT = 64
"""Paths a job keeps in its record (every keyword left out is among them at least once)."""

_SUBSCHEMA = ("additionalProperties", "additionalItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_APPLICATORS = ("$ref", "anyOf", "oneOf", "allOf")
_ANNOTATIONS = frozenset(
    {
        "$anchor",
        "$defs",
        "definitions",
        "$schema",
        "$id",
        "id",
        "$comment",
        "title",
        "description",
        "default",
        "readOnly",
        "writeOnly",
        "examples",
        "contentMediaType",
        "contentEncoding",
        "x-guidance",
    }
)
"""Keywords that say nothing about what is valid (llguidance's list, and its own options)."""
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_ONE_OF = "oneOf"
_COUNTS = ("minProperties", "maxProperties")
_MIN_MAX_PROPERTIES = "min/maxProperties"
_CIRCULAR = re.compile(r"circular references with sibling keys are not supported: \S*?(#\S*)")
_NOT_DISJOINT = re.compile(r"patternProperty regexes /(.*)/ and /(.*)/ are not disjoint")
_MISSING_RESOURCE = re.compile(r"Resource '([^']+)' is not present in a registry")
_UNSATISFIABLE_REQUIRED = re.compile(r"required property '([^']*)' is unsatisfiable")


@dataclass(frozen=True, slots=True)
class SchemaPlan:
    """How a schema becomes a grammar."""

    schema: dict[str, Any]
    """What the grammar is made from: the schema, less the parts left out of a lenient one."""
    unenforced: list[str]
    """Lenient: paths (dotted, from the schema's root) of the keywords the grammar does not
    enforce, each keyword's first place first, at most UNENFORCED_KEPT."""
    gap: str | None = None
    """Strict: the path of a keyword the grammar cannot enforce (the request is refused)."""


def plan_schema(schema: dict[str, Any], strict: bool) -> SchemaPlan:
    """The grammar's schema and what it leaves out (lenient), or the first keyword it cannot
    enforce (strict). A schema that fails for another reason is returned as it is: compiling
    it gives the error."""
    if strict:
        failed, messages = _validate(schema, lenient=False)
        if not failed:
            return SchemaPlan(schema, [])
        failed, warnings = _validate(schema, lenient=True)
        if failed or not warnings:
            return SchemaPlan(schema, [])
        found = locate(schema, warnings)
        return SchemaPlan(schema, [], gap=found[0] if found else "")
    relaxed, dropped = schema, list[str]()
    for _ in range(MAX_RELAXATIONS):
        failed, messages = _validate(relaxed, lenient=True)
        if not failed:
            return SchemaPlan(relaxed, _kept([*locate(relaxed, messages), *dropped]))
        step = _relax(relaxed, messages[0] if messages else "")
        if step is None:
            break
        relaxed, more = step
        dropped += more
    return SchemaPlan(schema, [])


def dotted(path: str, prefix: str) -> str:
    """A path from `plan_schema` under the request field that holds the schema."""
    return f"{prefix}.{path}" if path else prefix


def keyword_of(path: str) -> str:
    """The keyword a path ends in (every path `plan_schema` gives ends in one)."""
    return path.rsplit(".", 1)[-1]


def _validate(schema: dict[str, Any], lenient: bool) -> tuple[bool, list[str]]:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, JSON_COMPILE_OPTIONS, json_options(lenient)
    )
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    return bool(failed), [str(m) for m in messages]


def _kept(paths: list[str]) -> list[str]:
    """Each keyword's first path first, then the rest, without repeats, at most
    UNENFORCED_KEPT."""
    seen: set[str] = set()
    first: list[str] = []
    for p in paths:
        if keyword_of(p) not in seen:
            seen.add(keyword_of(p))
            first.append(p)
    rest = [p for p in dict.fromkeys(paths) if p not in first]
    return (first + rest)[:UNENFORCED_KEPT]


# ---- where the warnings' keywords are -----------------------------------------------------


def locate(schema: dict[str, Any], messages: list[str]) -> list[str]:
    """The paths of what llguidance's warnings (or its strict error) say it does not enforce,
    in the order the compiler meets them; a warning it cannot place gives the root's path."""
    keys: set[str] = set()
    formats: set[str] = set()
    unplaced = False
    for m in messages:
        if (hit := _UNIMPLEMENTED.search(m)) is not None:
            keys.update(str(k) for k in json.loads(hit.group(1)))
        elif (hit := _UNKNOWN_FORMAT.search(m)) is not None:
            formats.add(hit.group(1))
        elif _ONE_OF in m:
            keys.add(_ONE_OF)
        elif _MIN_MAX_PROPERTIES in m:
            keys.update(_COUNTS)
        else:
            unplaced = True
    found: list[str] = []
    for path, node in compiled_nodes(schema):
        for key, value in node.items():
            if key in _COUNTS and _all_required(node):
                continue  # llguidance enforces a property count where every one is required
            if key in keys or (key == "format" and isinstance(value, str) and value in formats):
                found.append(".".join((*path, key)))
    if unplaced or (not found and messages):
        found.append("")
    return found


def _all_required(node: dict[str, Any]) -> bool:
    props, required = node.get("properties"), node.get("required")
    return isinstance(props, dict) and isinstance(required, list) and set(props) <= set(required)


def compiled_nodes(schema: Any) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every subschema llguidance compiles, with the path where it is written: from the root
    through the keywords it implements and local `$ref`s (each place once)."""
    seen: set[Path] = set()
    todo: list[tuple[Path, Any]] = [((), schema)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict) or path in seen:
            continue
        seen.add(path)
        yield path, node
        todo.extend(reversed(list(_children(schema, path, node))))


def _children(root: Any, path: Path, node: dict[str, Any]) -> Iterator[tuple[Path, Any]]:
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            target = _pointer_path(value)
            if target is not None:
                yield target, resolve_pointer(root, value)
        elif key in _SUBSCHEMA and isinstance(value, dict):
            yield (*path, key), value
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            yield from (((*path, key, name), sub) for name, sub in value.items())
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            yield from (((*path, key, str(i)), sub) for i, sub in enumerate(value))


def _pointer_path(ref: str) -> Path | None:
    """`#/$defs/a~1b` as a path (`$defs`, `a/b`); None for an anchor (`#name`)."""
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return None
    parts = pointer.split("/")[1:]
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in parts)


# ---- leaving out what llguidance cannot compile -------------------------------------------


def _relax(schema: dict[str, Any], error: str) -> tuple[dict[str, Any], list[str]] | None:
    """The schema less the part `error` names, and the paths left out; None when the error
    names no part that can be left out."""
    copy: dict[str, Any] = json.loads(json.dumps(schema))
    dropped: list[str] = []
    nodes = list(compiled_nodes(copy))
    if (hit := _CIRCULAR.search(error)) is not None:
        dropped = _drop_ref_siblings(nodes, hit.group(1))
    elif (hit := _NOT_DISJOINT.search(error)) is not None:
        first, second = hit.group(1), hit.group(2)
        for path, node in nodes:  # the second of the two left out: its names are the first's
            props = node.get("patternProperties")
            if isinstance(props, dict) and first in props and second in props:
                del props[second]
                dropped.append(".".join((*path, "patternProperties")))
    elif (hit := _MISSING_RESOURCE.search(error)) is not None:
        dropped = _drop_remote_refs(nodes, hit.group(1))
    elif (hit := _UNSATISFIABLE_REQUIRED.search(error)) is not None:
        dropped = _drop_required(nodes, hit.group(1))
    elif "regex" in error:
        dropped = _drop_bad_patterns(nodes)
    return (copy, dropped) if dropped else None


def _drop_ref_siblings(nodes: list[tuple[Path, dict[str, Any]]], pointer: str) -> list[str]:
    """llguidance cannot intersect a recursive `$ref` with other schemas. Left out, in turn,
    until it compiles: the keywords beside a reference to it (beside `$ref`, or beside the
    `anyOf`, `oneOf` or `allOf` that holds it); then the reference where `allOf` intersects
    it with more; then every reference to it (any value there)."""
    dropped: list[str] = []
    for path, node in nodes:
        if pointer in _refs_made(node):
            for key in [k for k in node if k not in _APPLICATORS and k not in _ANNOTATIONS]:
                del node[key]
                dropped.append(".".join((*path, key)))
    if dropped:
        return dropped
    for path, node in nodes:
        members = node.get("allOf")
        if isinstance(members, list) and len(members) > 1:
            for i, m in enumerate(members):
                if isinstance(m, dict) and m.get("$ref") == pointer:
                    members[i] = {}
                    dropped.append(".".join((*path, "allOf", str(i), "$ref")))
    if dropped:
        return dropped
    for path, node in nodes:
        if node.get("$ref") == pointer:
            del node["$ref"]
            dropped.append(".".join((*path, "$ref")))
    return dropped


def _refs_made(node: dict[str, Any]) -> set[str]:
    refs = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
    for key in ("anyOf", "oneOf", "allOf"):
        members = node.get(key)
        if isinstance(members, list):
            refs |= {m["$ref"] for m in members if isinstance(m, dict) and "$ref" in m}
    return {r for r in refs if isinstance(r, str)}


def _drop_remote_refs(nodes: list[tuple[Path, dict[str, Any]]], resource: str) -> list[str]:
    """A `$ref` to a document genq does not fetch: any value there (the ref left out)."""
    tail = resource.rsplit("///", 1)[-1].lstrip("/")
    dropped: list[str] = []
    for path, node in nodes:
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#") and ref.lstrip("/").startswith(tail):
            del node["$ref"]
            dropped.append(".".join((*path, "$ref")))
    return dropped


def _drop_required(nodes: list[tuple[Path, dict[str, Any]]], name: str) -> list[str]:
    """A required property llguidance cannot place (one that only a pattern property admits
    beside `additionalProperties: false`): no longer required by the grammar."""
    dropped: list[str] = []
    for path, node in nodes:
        required = node.get("required")
        if isinstance(required, list) and name in required:
            required.remove(name)
            dropped.append(".".join((*path, "required")))
    return dropped


def _drop_bad_patterns(nodes: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """Every `pattern` (and pattern property) whose regex llguidance cannot run."""
    dropped: list[str] = []
    for path, node in nodes:
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not _regex_runs(pattern):
            del node["pattern"]
            dropped.append(".".join((*path, "pattern")))
        props = node.get("patternProperties")
        if isinstance(props, dict) and not all(_regex_runs(p) for p in props):
            del node["patternProperties"]
            dropped.append(".".join((*path, "patternProperties")))
    return dropped


def _regex_runs(pattern: str) -> bool:
    failed, _ = _validate({"type": "string", "pattern": pattern}, lenient=True)
    return not failed
