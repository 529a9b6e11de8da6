"""The checks genq adds to llguidance's: Lark grammars that can never end, `$ref` loops, where
a schema's unenforceable keywords are (and what a lenient one leaves out); and the worker's
batched masks agreeing with one matcher's own."""

from __future__ import annotations

import pytest

from shared.constraints import grammar_of, ref_loop
from shared.lark_check import unfinishable
from shared.schema_gaps import plan_schema
from worker.constraint import Grammars, MaskBatch, allowed_ids, allows
from worker.sim import SimEngine


@pytest.mark.parametrize(
    ("lark", "ends"),
    [
        ('start: "x" start', False),
        ('start: a\na: a "x"', False),
        ("start: a\na: b\nb: a", False),
        ('start: ("a" start)', False),
        ('start: /x+/ b\nb: "y" b', False),
        ('start: a\na: "x" a | "y"', True),
        ('start: ["a" start]', True),
        ('start: item*\nitem: "x" item', True),
        ('start: "a" | start start', True),
        ('start: a{2,3}\na: "q"', True),
        ("%llguidance {}\nstart: TEXT\nTEXT: /(.|\\n)*/", True),
        ('start: "<tool_call>" %json {"type": "object"} "</tool_call>"', True),
        ("%import common.NUMBER\nstart: NUMBER", True),
    ],
)
def test_unfinishable_finds_grammars_that_cannot_end(lark: str, ends: bool) -> None:
    assert (unfinishable(lark) is None) is ends


@pytest.mark.parametrize(
    ("schema", "loops"),
    [
        ({"$ref": "#"}, True),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, True),
        ({"allOf": [{"type": "object"}, {"$ref": "#"}]}, True),
        ({"anyOf": [{"$ref": "#/$defs/b"}], "$defs": {"b": {"$ref": "#"}}}, True),
        ({"anyOf": [{"type": "null"}, {"$ref": "#"}]}, False),
        (
            {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
            False,
        ),
        ({"type": "string"}, False),
    ],
)
def test_ref_loop_finds_refs_that_consume_nothing(schema: dict, loops: bool) -> None:
    assert (ref_loop(schema) is not None) is loops


TAGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.mark.parametrize(
    ("schema", "gap", "unenforced"),
    [
        ({"properties": {"tags": TAGS}}, "properties.tags.uniqueItems", None),
        (
            {"$defs": {"T": TAGS}, "items": {"$ref": "#/$defs/T"}, "not": {"type": "null"}},
            "not",  # the root's own keywords come first, then what they lead to
            ["$defs.T.uniqueItems", "not"],
        ),
        ({"$defs": {"unused": TAGS}, "type": "string"}, None, []),  # never compiled
        ({"properties": {"d": {"format": "x-made-up"}}}, "properties.d.format", None),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", None),  # overlapping
        ({"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if", ["if", "then"]),
        # a regex llguidance cannot run is left out of a lenient grammar (strict: its 400)
        ({"properties": {"u": {"pattern": "^(?!x).*$"}}}, None, ["properties.u.pattern"]),
    ],
)
def test_a_schema_plan_names_what_the_grammar_does_not_enforce(
    schema: dict, gap: str | None, unenforced: list[str] | None
) -> None:
    assert plan_schema(schema, strict=True).gap == gap
    lenient = plan_schema(schema, strict=False)
    assert lenient.gap is None
    assert sorted(lenient.unenforced) == sorted(unenforced if unenforced is not None else [gap])


def test_batched_masks_equal_each_matchers_own() -> None:
    sim = SimEngine()
    grammars = Grammars(sim.tokenizer_json, sim.card.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]}
    matchers = [
        grammars.matcher(grammar_of("json_schema", schema)),
        grammars.matcher(grammar_of("regex", "[0-9]+")),
        grammars.matcher(grammar_of("json_schema", schema), replay=[]),
    ]
    assert matchers[2].consume(grammars.tokenizer.tokenize_str("{")[0])
    rows = MaskBatch(grammars.vocab_size, threads=2).fill(matchers)
    for m, row in zip(matchers, rows, strict=True):
        own = m.allowed_bits()
        assert bytes(row) == own
        ids = allowed_ids(row, grammars.vocab_size)
        assert ids and all(allows(row, t) for t in ids)
        assert not allows(row, max(set(range(grammars.vocab_size)) - set(ids)))
