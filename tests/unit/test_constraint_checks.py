"""The checks genq adds to llguidance's: Lark grammars that can never end, `$ref` loops; and
the worker's batched masks agreeing with one matcher's own."""

from __future__ import annotations

import pytest

from shared.constraints import grammar_of, ref_loop
from shared.lark_check import unfinishable
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
