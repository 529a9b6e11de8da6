"""The checks genq adds to llguidance's: Lark grammars that can never end, `$ref` loops, where
a schema's regexes are, and its unenforceable keywords (and what a lenient one leaves out);
the worker's batched masks agreeing with one matcher's own; and a matcher that fails telling
the job so (never a quiet end)."""

from __future__ import annotations

import pytest

from gateway.constraint_errors import patterns
from shared.constraints import CONSTRAINT_FAILED, grammar_of, ref_loop
from shared.lark_check import unfinishable
from shared.schema_gaps import plan_schema
from shared.schemas import Sampling
from worker.constraint import ConstraintError, Grammars, MaskBatch, allowed_ids, allows
from worker.core import AddCommand, EngineCore
from worker.engine import EngineJob
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


def test_patterns_are_found_with_their_path_in_the_schema() -> None:
    schema = {
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "pattern": {"type": "string"},  # a property named so: no regex
            "tags": {"items": [{"pattern": "a"}, {"anyOf": [{"pattern": "b"}]}]},
        },
        "patternProperties": {"^x-": {"pattern": "c"}},
        "$defs": {"d": {"additionalProperties": {"pattern": "d"}}},
        "enum": [{"pattern": "not a schema"}],
    }
    assert list(patterns(schema, "json_schema")) == [
        ("json_schema.patternProperties.^x-", "^x-"),
        ("json_schema.patternProperties.^x-.pattern", "c"),
        ("json_schema.properties.code.pattern", "^[A-Z]{2}$"),
        ("json_schema.properties.tags.items.0.pattern", "a"),
        ("json_schema.properties.tags.items.1.anyOf.0.pattern", "b"),
        ("json_schema.$defs.d.additionalProperties.pattern", "d"),
    ]


def test_a_failed_matcher_is_neither_stopped_nor_takes_eos() -> None:
    """llguidance calls a failed matcher stopped and takes EOS from it (its mask is EOS
    alone); genq's `JobMatcher` says it failed."""
    sim = SimEngine()
    grammars = Grammars(sim.tokenizer_json, sim.card.eos_token_ids)
    m = grammars.matcher(grammar_of("regex", "abc"))
    assert not m.consume(grammars.tokenizer.tokenize_str("x")[0])
    assert m.failed and not m.stopped and m.error
    assert not m.consume(sim.card.eos_token_ids[0])


def test_a_sim_job_whose_matcher_failed_ends_with_the_error_not_stop() -> None:
    sim = SimEngine(step_ms=0)
    sim.add(EngineJob("j", [5, 6], 40, Sampling(), 7, grammar=grammar_of("regex", "[a-z]{20}")))
    sim.step()
    sim._jobs["j"].matcher.m.consume_token(sim.card.eos_token_ids[0])  # as a limit would
    [out] = sim.step()
    assert out.finish_reason is None and out.error_code == CONSTRAINT_FAILED
    assert "after 1 generated tokens" in (out.error or "") and not sim.active()


@pytest.mark.parametrize(
    ("grammar", "resume"), [("start: %%%", []), (grammar_of("regex", "ab"), [99, 98, 97])]
)
def test_a_constraint_that_cannot_run_at_add_is_the_jobs_own_fault(
    grammar: str, resume: list[int]
) -> None:
    """A grammar that does not build on this worker, or a replay that does not fit: the
    engine refuses the job as its own fault (`constraint_failed`), not as a worker's."""
    core = EngineCore(SimEngine())
    job = EngineJob("j", [5, 6], 8, Sampling(), 7, resume_ids=resume, grammar=grammar)
    [out] = core.apply([AddCommand(job, attempt=1)])
    assert out.error_code == CONSTRAINT_FAILED and out.attempt == 1 and out.error
    assert core.failures == 0 and not core.engine.active()
    with pytest.raises(ConstraintError):
        Grammars(SimEngine().tokenizer_json, [1]).matcher(grammar, resume)
