"""GENQ_DETOKENIZE=worker: the text made in the worker from token ids, and the stop strings
matched there, are exactly what the sim engine makes itself (its semantics are the
reference: held-back text, cuts, resumes); a stop string found by the worker stops the job
in the engine at most a step late, and nothing past it is ever sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shared.schemas import Sampling
from shared.settings import Settings
from worker.engine import EngineJob, StepOutput
from worker.engine_client import EngineProcess
from worker.link import STOP_STRING, EngineLink
from worker.runner import EngineRunner
from worker.sim import SimEngine, build_tokenizer
from worker.text import Detokenizer, TextStream

PROMPT = "job 7 the model"
MAX_TOKENS = 40
TIMEOUT_S = 10.0
STOPPED_WITHIN_S = 0.2
"""A few 20 ms steps; the job would run 40 of them if the worker did not stop it."""
MakeLink = Callable[..., Awaitable[EngineLink]]


def _job(sampling: Sampling, resume_ids: list[int] | None = None, job_id: str = "j") -> EngineJob:
    ids = build_tokenizer().encode(PROMPT, add_special_tokens=False).ids
    return EngineJob(job_id, ids, MAX_TOKENS, sampling, seed=7, resume_ids=resume_ids or [])


def _engine_made(job: EngineJob) -> list[StepOutput]:
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    engine.add(job)
    out: list[StepOutput] = []
    while engine.active():
        out += engine.step()
    return out


def _worker_made(job: EngineJob) -> list[StepOutput]:
    """The sim with text off, its token ids through a TextStream, as the link does it."""
    engine = SimEngine(step_ms=0, prefill_ms_per_1k=0)
    stream = Detokenizer(engine.tokenizer_json).stream(
        job.sampling.stop, job.input_ids, job.resume_ids
    )
    engine.add(EngineJob(**{**_fields(job), "text": False}))
    out: list[StepOutput] = []
    while engine.active() and not stream.done:
        for o in engine.step():
            o.text, keep = stream.feed(o.token_ids, o.finish_reason is not None)
            del o.token_ids[keep:]
            if stream.done:
                o.finish_reason = "stop"
            out.append(o)
    return out


def _fields(job: EngineJob) -> dict:
    return {name: getattr(job, name) for name in EngineJob.__slots__}  # type: ignore[attr-defined]


def _seen(outs: list[StepOutput]) -> list[tuple[str, list[int], str | None]]:
    return [(o.text, o.token_ids, o.finish_reason) for o in outs]


def _text(outs: list[StepOutput]) -> str:
    return "".join(o.text for o in outs)


def _stop_across_tokens(n: int = 10) -> str:
    plain = _engine_made(_job(Sampling(seed=7)))
    return plain[n].text + plain[n + 1].text[:2]


@pytest.mark.parametrize(
    "stop",
    [[], ["zz-never"], "across tokens", "two stops"],
    ids=["none", "never-found", "across-tokens", "two-stops"],
)
def test_worker_made_text_is_the_engines_output_for_output(stop: list[str] | str) -> None:
    if stop == "across tokens":
        stop = [_stop_across_tokens()]
    elif stop == "two stops":
        stop = [_stop_across_tokens(20), _stop_across_tokens(8)]
    assert isinstance(stop, list)
    sampling = Sampling(seed=7, stop=stop)
    assert _seen(_worker_made(_job(sampling))) == _seen(_engine_made(_job(sampling)))


def test_resumed_at_every_position_the_worker_continues_the_text_exactly() -> None:
    """A stop string spanning the resume point is found, and the text the earlier attempt
    held back is sent by the next one."""
    sampling = Sampling(seed=7, stop=[_stop_across_tokens()])
    full = _engine_made(_job(sampling))
    assert full[-1].finish_reason == "stop"
    for k in range(1, len(full)):
        sent_ids = [t for o in full[:k] for t in o.token_ids]
        resumed = _worker_made(_job(sampling, sent_ids))
        assert _text(full[:k]) + _text(resumed) == _text(full), k
        assert resumed[-1].finish_reason == "stop"


def test_the_first_token_keeps_its_leading_space_after_the_prompt() -> None:
    """A SentencePiece-style decoder drops the leading space of a text's first token; the
    prompt's last tokens are the stream's context, so a reply's first word keeps it."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    stream = TextStream(tok, [], prompt_ids=[1], resume_ids=[])
    assert stream.feed([2, 3], finished=False) == (" world again", 2)
    assert tok.decode([2, 3]) == "world again"  # what a stream without context would say


# ---- across the boundary ---------------------------------------------------------------------


@pytest.fixture(params=["thread", "process"])
async def make_link(request: pytest.FixtureRequest) -> AsyncIterator[MakeLink]:
    links: list[EngineLink] = []

    async def make(step_ms: float = 0.0) -> EngineLink:
        link: EngineLink
        if request.param == "thread":
            engine = SimEngine(step_ms=step_ms, prefill_ms_per_1k=0)
            link = EngineRunner(engine, detokenize=True)
        else:
            settings = Settings(sim_step_ms=step_ms, sim_prefill_ms_per_1k=0, detokenize="worker")
            link = await EngineProcess.spawn(settings)
        link.start(asyncio.get_running_loop(), lambda: None)
        links.append(link)
        return link

    yield make
    for link in links:
        await link.aclose()


async def _until_end(link: EngineLink, job_id: str) -> list[StepOutput]:
    out: list[StepOutput] = []
    async with asyncio.timeout(TIMEOUT_S):
        while not any(o.job_id == job_id and o.finish_reason for o in out):
            out += link.drain()
            await asyncio.sleep(0.002)
    return out


async def test_stop_strings_across_the_boundary(make_link: MakeLink) -> None:
    link = await make_link()
    sampling = Sampling(seed=7, stop=[_stop_across_tokens()])
    link.add(_job(sampling), 1)
    out = await _until_end(link, "j")
    assert _seen(out) == _seen(_engine_made(_job(sampling)))
    assert all(o.attempt == 1 for o in out)


async def test_a_stop_string_stops_the_job_in_the_engine_and_nothing_after_is_sent(
    make_link: MakeLink,
) -> None:
    link = await make_link(step_ms=20)  # slow: the cancel lands while the job still runs
    sampling = Sampling(seed=7, stop=[_stop_across_tokens(3)])
    expected = _text(_engine_made(_job(sampling)))
    sent: list[str] = []
    link.cancel = _recording(link.cancel, sent)  # type: ignore[method-assign]
    link.add(_job(sampling), 1)
    out = await _until_end(link, "j")
    assert _text(out) == expected and out[-1].finish_reason == "stop"
    assert sent == ["j"]  # the worker stopped it in the engine
    async with asyncio.timeout(STOPPED_WITHIN_S):  # the job left the engine at once
        while link.engine_free_slots < link.max_batch:
            await asyncio.sleep(0.005)
    after: list[StepOutput] = []
    for _ in range(5):  # several of the engine's steps: nothing more of the job comes out
        await asyncio.sleep(0.02)
        after += link.drain()
    assert after == []


def _recording(cancel: Callable[..., None], sent: list[str]) -> Callable[..., None]:
    def record(job_id: str, attempt: int, stop: object) -> None:
        assert stop == STOP_STRING and attempt == 1
        sent.append(job_id)
        cancel(job_id, attempt, stop)

    return record
