"""The sim engine resumed at any token gives exactly the text of an undisturbed run, stop
strings included (the continuation guarantee the chaos tests rely on)."""

from __future__ import annotations

import pytest

from gateway.openai.toolcalls import FORMATS, check_tools, grammar_for
from shared.constraints import grammar_of
from shared.schemas import Sampling
from worker.engine import EngineJob, StepOutput
from worker.sim import SPECIAL_TOKENS, SimEngine, build_tokenizer

PROMPT = "job 7 the model"
MAX_TOKENS = 40


def _run(job: EngineJob, engine: SimEngine | None = None) -> list[StepOutput]:
    engine = engine or SimEngine(step_ms=0, prefill_ms_per_1k=0)
    engine.add(job)
    outputs: list[StepOutput] = []
    while engine.active():
        outputs += engine.step()
    return outputs


def _job(
    sampling: Sampling,
    resume_ids: list[int] | None = None,
    grammar: str | None = None,
    max_tokens: int = MAX_TOKENS,
) -> EngineJob:
    ids = build_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    seed = sampling.seed if sampling.seed is not None else 7
    return EngineJob(
        "j", ids, max_tokens, sampling, seed=seed, resume_ids=resume_ids or [], grammar=grammar
    )


def _text(outputs: list[StepOutput]) -> str:
    return "".join(o.text for o in outputs)


MODEL, WILL = (build_tokenizer().token_to_id(w) for w in ("Ġmodel", "Ġwill"))
SAMPLINGS = [
    Sampling(seed=7),
    Sampling(
        seed=7,
        logit_bias={str(MODEL): 2.0},
        banned_strings=["ER", "s w"],
        stop_token_ids=[WILL],
        min_tokens=30,
    ),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_resumed_run_continues_the_text_at_every_position(sampling: Sampling) -> None:
    full = _run(_job(sampling))
    for k in range(1, MAX_TOKENS):
        sent_ids = [t for o in full[:k] for t in o.token_ids]
        resumed = _run(_job(sampling, sent_ids))
        assert _text(full[:k]) + _text(resumed) == _text(full)


def test_stop_string_spanning_the_resume_point_is_found_and_held_text_kept() -> None:
    plain = _run(_job(Sampling(seed=7)))
    stop = plain[10].text + plain[11].text  # spans the boundary between tokens 11 and 12
    sampling = Sampling(seed=7, stop=[stop])
    full = _run(_job(sampling))
    assert full[-1].finish_reason == "stop"
    for k in range(1, len(full)):
        sent_ids = [t for o in full[:k] for t in o.token_ids]
        resumed = _run(_job(sampling, sent_ids))
        assert _text(full[:k]) + _text(resumed) == _text(full), k
        assert resumed[-1].finish_reason == "stop"


RESUME_STRIDE = 3
"""Resume points of the constrained runs: every third token, and each side of a call's start
and of a token whose text was held (a character's first bytes)."""
PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOLS = check_tools(
    [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("f", "g")],
    "required",
    None,
)


@pytest.mark.parametrize(
    ("grammar", "seed", "marker", "times"),
    [
        (
            grammar_of("grammar", grammar_for(FORMATS["hermes"], TOOLS, frozenset(SPECIAL_TOKENS))),
            5,
            SPECIAL_TOKENS[0],
            3,
        ),
        (grammar_of("regex", "(a\u2028|b\u00e9\u2029)+"), 2, "\u2029", 4),
    ],
    ids=["tool calls", "characters of several bytes"],
)
def test_a_constrained_run_resumed_anywhere_continues_it(
    grammar: str, seed: int, marker: str, times: int
) -> None:
    """Its tool calls counted again (as many as an undisturbed run makes), and a character
    whose bytes the resume point splits emitted once, whole."""
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    full = _run(_job(Sampling(seed=seed), grammar=grammar, max_tokens=120), engine)
    text = _text(full)
    assert text.count(marker) == times, text
    call = build_tokenizer().token_to_id(SPECIAL_TOKENS[0])
    opened = [k for k, o in enumerate(full) if call in o.token_ids or not o.text]
    for k in sorted({*range(1, len(full), RESUME_STRIDE), *opened, *(k + 1 for k in opened)}):
        sent_ids = [t for o in full[:k] for t in o.token_ids]
        resumed = _run(_job(Sampling(seed=seed), sent_ids, grammar, max_tokens=120), engine)
        assert _text(full[:k]) + _text(resumed) == text, k
