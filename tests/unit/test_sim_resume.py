"""The sim engine resumed at any token gives exactly the text of an undisturbed run, stop
strings included (the continuation guarantee the chaos tests rely on)."""

from __future__ import annotations

import pytest

from shared.schemas import Sampling
from worker.engine import EngineJob, StepOutput
from worker.sim import SimEngine, build_tokenizer

PROMPT = "job 7 the model"
MAX_TOKENS = 40


def _run(job: EngineJob) -> list[StepOutput]:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    engine.add(job)
    outputs: list[StepOutput] = []
    while engine.active():
        outputs += engine.step()
    return outputs


def _job(sampling: Sampling, resume_ids: list[int] | None = None) -> EngineJob:
    ids = build_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    return EngineJob("j", ids, MAX_TOKENS, sampling, seed=7, resume_ids=resume_ids or [])


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
