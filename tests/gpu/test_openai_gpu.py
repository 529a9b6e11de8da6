"""The official openai SDK, sync and async, against `genq gateway` + `genq worker` running a real
engine on a tiny synth model: the OpenAI SDK tests of tests/openai, once per engine and model
(exllamav2 fp16, exllamav3 fp16, exllamav3 EXL3 — the engine picked from the folder). Real
processes, real Redis; chat goes through the model's own template (the synth model's
tokenizer_config.json carries a Llama-3-style one)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam
from tokenizers import Tokenizer

from shared.keys import Keys
from shared.schemas import JobSpec
from tests.prefixes import test_prefix
from tests.procs import Cluster, wait_for

pytestmark = pytest.mark.gpu
API_KEY = "sk-genq-gpu"
QUEUE_LIMIT = 2
LONG = 3500
"""Tokens: several seconds of generation for one job of the tiny model (context 4096)."""
SLOT_FREE_S = 1.0
HEARTBEAT_S = 0.1
WORKER_READY_S = 300.0
"""Loading, warm-up and (exllamav3 on a cold Triton cache) kernel compilation."""
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "def main():"}]
SERVED = ["exllamav2", "exllamav3", "exllamav3-exl3"]
"""Engine (and model) per run of this module; the EXL3 folder is run without --engine."""


class Genq:
    def __init__(self, cluster: Cluster, gateway_url: str, model: Path, keys: Keys) -> None:
        self.cluster = cluster
        self.url = gateway_url
        self.model = model.name
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.keys = keys
        self.db = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        self.native = httpx.Client(
            base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        )

    def spec(self, job_id: str) -> JobSpec:
        return JobSpec.model_validate_json(str(self.db.hget(self.keys.job(job_id), "spec")))

    def job(self, job_id: str) -> dict:  # type: ignore[type-arg]
        r = self.native.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def running(self) -> int:
        """Jobs the worker holds in its generator, from its heartbeat (every HEARTBEAT_S)."""
        beats = [self.db.hget(k, "active") for k in self.db.scan_iter(self.keys.worker("*"))]
        return sum(int(json.loads(b)) for b in beats if b)


@pytest.fixture(scope="module", params=SERVED)
def served(request: pytest.FixtureRequest, tiny_model: Path) -> tuple[Path, list[str]]:
    """The model folder and the engine flags of this run."""
    if request.param == "exllamav2":
        pytest.importorskip("exllamav2")
        return tiny_model, ["--engine", "exllamav2"]
    pytest.importorskip("exllamav3")
    if request.param == "exllamav3":
        return tiny_model, ["--engine", "exllamav3"]
    return Path(request.getfixturevalue("tiny_exl3_model")), []


@pytest.fixture(scope="module")
def genq(
    served: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Genq]:
    model, engine = served
    redis_url = os.environ.get("GENQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = test_prefix("gpu-openai")
    cluster = Cluster(
        redis_url,
        tmp_path_factory.mktemp("openai-gpu"),
        prefix,
        GENQ_API_KEYS=json.dumps([API_KEY]),
        GENQ_OPENAI_MAX_QUEUE_DEPTH=str(QUEUE_LIMIT),
    )
    try:
        gw = cluster.gateway()
        worker_args = [*engine, "--model", str(model), "--max-batch", "16"]
        worker_args += ["--cache-tokens", "65536"]
        cluster.worker(*worker_args, wait_model=None, GENQ_HEARTBEAT_S=str(HEARTBEAT_S))
        g = Genq(cluster, gw.url, model, Keys(prefix))
        wait_for(
            lambda: g.native.get("/v1/models").json()["data"],
            timeout=WORKER_READY_S,
            what=f"the worker: {cluster.procs[-1].output()[-2000:]}",
        )
        yield g
        g.native.close()
        g.db.close()
    finally:
        cluster.close()


@pytest.fixture
def client(genq: Genq) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{genq.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def aclient(genq: Genq) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{genq.url}/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, genq: Genq) -> None:
    assert [m.id for m in client.models.list()] == [genq.model]


def test_greedy_completion_is_a_job_and_repeats(client: openai.OpenAI, genq: Genq) -> None:
    r = client.completions.create(
        model=genq.model, prompt="import os\n", max_tokens=24, temperature=0
    )
    [choice] = r.choices
    spec = genq.spec(r.id.removeprefix("cmpl-"))
    assert r.usage is not None and r.usage.prompt_tokens == len(spec.input_ids)
    assert genq.tokenizer.decode(spec.input_ids) == "import os\n"
    assert choice.finish_reason in ("length", "stop")
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    job = genq.job(r.id.removeprefix("cmpl-"))
    assert job["status"] == "succeeded" and job["priority"] == "interactive"
    assert job["text"] == choice.text
    again = client.completions.create(
        model=genq.model, prompt="import os\n", max_tokens=24, temperature=0
    )
    assert again.choices[0].text == choice.text


async def test_async_and_streamed_completion_match_the_plain_one(
    aclient: openai.AsyncOpenAI, client: openai.OpenAI, genq: Genq
) -> None:
    args = {"model": genq.model, "prompt": "class A:", "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    async with aclient:
        same = await aclient.completions.create(**args)
        stream = await aclient.completions.create(**args, stream=True)
        chunks = [c async for c in stream]
    assert same.choices[0].text == whole.choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_renders_the_models_own_template(client: openai.OpenAI, genq: Genq) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        *USER,
    ]
    r = client.chat.completions.create(model=genq.model, messages=messages, max_tokens=8)
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    spec = genq.spec(r.id.removeprefix("chatcmpl-"))
    assert genq.tokenizer.decode(spec.input_ids, skip_special_tokens=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\ndef main():<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(spec.input_ids)


def test_streamed_chat_with_usage(client: openai.OpenAI, genq: Genq) -> None:
    args = {"model": genq.model, "messages": USER, "max_tokens": 40, "temperature": 0}
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last_choice, usage = chunks
    assert all(c.id == chunks[0].id for c in chunks)
    assert last_choice.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    # cached_tokens may differ: the second run finds the first one's prompt in the page cache
    assert [getattr(usage.usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    text = "".join(c.choices[0].delta.content or "" for c in [*body, last_choice])
    assert text == whole.choices[0].message.content


def test_n_2_with_a_seed_runs_two_jobs_and_repeats(client: openai.OpenAI, genq: Genq) -> None:
    args = {"model": genq.model, "messages": USER, "max_tokens": 16, "n": 2, "seed": 11}
    raw = client.chat.completions.with_raw_response.create(**args)  # type: ignore[call-overload]
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1]
    job_ids = raw.headers["x-job-ids"].split(",")
    assert len(job_ids) == 2
    for i, job_id in enumerate(job_ids):
        job = genq.job(job_id)
        assert job["status"] == "succeeded" and job["text"] == r.choices[i].message.content
    again = client.chat.completions.create(**args)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, genq: Genq) -> None:
    args = {"model": genq.model, "prompt": "for i in range(", "max_tokens": 40, "temperature": 0}
    text = client.completions.create(**args).choices[0].text  # type: ignore[call-overload]
    assert len(text) >= 12, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    stopped = client.completions.create(**args, stop=[stop, "\x00never"])  # type: ignore[call-overload]
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    stream = client.completions.create(**args, stop=stop, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in stream) == expected


def test_logprobs_from_the_engine(client: openai.OpenAI, genq: Genq) -> None:
    r = client.chat.completions.create(
        model=genq.model, messages=USER, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.usage is not None and content is not None
    assert len(content) == r.usage.completion_tokens
    assert all(t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 3 for t in content)


def test_errors_are_the_sdks_exceptions(client: openai.OpenAI, genq: Genq) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=genq.model, prompt="x " * 2000, max_tokens=4000)
    assert bad.value.code == "context_length_exceeded"
    assert "maximum context length of 4096 tokens" in bad.value.message
    with openai.OpenAI(base_url=f"{genq.url}/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError) as invalid:
        client.chat.completions.create(model=genq.model, messages=USER, top_p=1.5)
    assert invalid.value.param == "top_p"
    # a model whose worker is gone: its card, as a worker wrote it, with no heartbeat behind it
    card = genq.db.hgetall(genq.keys.model_card(genq.model))
    gone = json.loads(card["card"]) | {"name": "gone"}
    genq.db.hset(genq.keys.model_card("gone"), mapping={**card, "card": json.dumps(gone)})
    genq.db.sadd(genq.keys.models(), "gone")
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.chat.completions.create(model="gone", messages=USER)
    assert unavailable.value.status_code == 503


def _first_chunk_then_leave(genq: Genq, out: list[str]) -> None:
    with openai.OpenAI(base_url=f"{genq.url}/v1", api_key=API_KEY, max_retries=0) as c:
        stream = c.chat.completions.create(
            model=genq.model, messages=USER, max_tokens=LONG, stream=True
        )
        out.append(next(iter(stream)).id.removeprefix("chatcmpl-"))
        stream.close()


def test_queue_limit_429_and_disconnect_frees_the_slot(client: openai.OpenAI, genq: Genq) -> None:
    # two long jobs fill the interactive queue (queued or running count), a third is refused
    held = [
        genq.native.post(
            "/v1/jobs", json={"model": genq.model, "prompt": "x", "max_tokens": LONG}
        ).json()["id"]
        for _ in range(QUEUE_LIMIT)
    ]
    try:
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=genq.model, prompt="x", max_tokens=4)
        assert limited.value.code == "queue_full"
    finally:
        for job_id in held:
            genq.native.delete(f"/v1/jobs/{job_id}")
    wait_for(lambda: genq.running() == 0, timeout=5, what="the long jobs cancelled")
    # a streaming client that goes away cancels its running job; the slot is free within 1 s
    out: list[str] = []
    t = threading.Thread(target=_first_chunk_then_leave, args=(genq, out))
    t.start()
    t.join(30)
    [job_id] = out
    left = time.monotonic()
    wait_for(lambda: genq.job(job_id)["status"] == "cancelled", timeout=5, what="cancelled")
    wait_for(lambda: genq.running() == 0, timeout=5, what="slot free")
    assert time.monotonic() - left < SLOT_FREE_S + HEARTBEAT_S


def test_a_completion_under_a_json_schema_is_valid_json(client: openai.OpenAI, genq: Genq) -> None:
    """genq's `json_schema` field through the gateway, the job record and the worker's engine
    (worker/dyngen/masks.py), sampled at temperature 1: the text fits the schema."""
    from tests.gpu.test_constraints_gpu import SCHEMA

    for seed in (1, 2):
        r = client.completions.create(
            model=genq.model,
            prompt="def main():",
            max_tokens=128,
            temperature=1.0,
            seed=seed,
            extra_body={"json_schema": SCHEMA},
        )
        [choice] = r.choices
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert genq.job(r.id.removeprefix("cmpl-"))["constraint"]["type"] == "json_schema"
