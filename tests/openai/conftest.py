"""One real genq for the OpenAI SDK tests: a gateway served by uvicorn on a free port and sim
workers, in a background thread with its own event loop, over the real Redis.

Models:
  sim         ChatML template from GENQ_CHAT_TEMPLATE (inline); fast
  sim-llama3  Llama-3 template from GENQ_CHAT_TEMPLATE (a file); fast
  sim-bare    no chat template
  sim-slow    ChatML; one job at a time, slow steps: queued and running jobs on demand
  sim-gone    a card, as its worker wrote it once, but no live worker
  sim-tools   the sim's own template (Hermes tool calls); fast
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn

from gateway.app import create_app
from shared.keys import Keys
from shared.schemas import JobSpec
from shared.settings import Settings
from tests.conftest import REDIS_URL, test_prefix
from worker.service import Worker
from worker.sim import SimEngine

API_KEY = "sk-genq-test"
OTHER_KEY = "sk-genq-other"
"""A second key: another owner."""
CHAT, LLAMA, BARE, SLOW, GONE = "sim", "sim-llama3", "sim-bare", "sim-slow", "sim-gone"
TOOLS = "sim-tools"
"""The sim's own template: Hermes-style tool calls."""
QUEUE_LIMIT = 4
"""GENQ_OPENAI_MAX_QUEUE_DEPTH: room for the largest request of the tests (4 jobs)."""
SLOW_STEP_MS = 50.0
SLOW_BATCH = 1
START_TIMEOUT_S = 15.0
POLL_S = 0.01

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (Qwen, …); refuses unknown roles through `raise_exception`."""

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
"""Meta-Llama-3-8B-Instruct's template, as in its tokenizer_config.json."""


class GenqServer:
    """The gateway and workers, on an event loop in a thread of their own."""

    def __init__(self, settings: Settings, workers: dict[str, tuple[Settings, SimEngine]]) -> None:
        self.settings = settings
        self._socket = socket.socket()  # bound here: no race for a free port with other tests
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.keys = Keys(settings.key_prefix)
        self.workers: dict[str, Worker] = {}
        self._specs = workers
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="genq-test-server", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._failed is not None:
            raise RuntimeError(f"genq test server did not start: {self._failed!r}")

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failed = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        tasks: dict[str, asyncio.Task[None]] = {}
        for name, (settings, engine) in self._specs.items():
            if name == GONE:  # its worker died long ago: a card, no heartbeat
                await _publish_card(client, self.keys, name, engine)
                continue
            worker = Worker(settings, engine, redis=client, model_name=name)
            self.workers[name] = worker
            tasks[name] = asyncio.create_task(worker.run())
        cards = [self.keys.model_card(n) for n in self.workers]
        while await client.exists(*cards) < len(cards):
            await asyncio.sleep(POLL_S)
        server = uvicorn.Server(
            uvicorn.Config(create_app(self.settings, redis=client), log_level="warning", ws="none")
        )
        serving = asyncio.create_task(server.serve(sockets=[self._socket]))
        while not server.started:
            if serving.done():
                raise RuntimeError(f"uvicorn stopped while starting: {serving.exception()!r}")
            await asyncio.sleep(POLL_S)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.should_exit = True
            await serving
            await self._stop_workers(list(tasks.values()))
            keys = [k async for k in client.scan_iter(match=f"{self.settings.key_prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
            self._socket.close()

    async def _stop_workers(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop every worker. Worker.run cancels its loops once; a cancel that lands inside a
        redis-py read can come back as a RedisError, which the claim loop retries, so a loop
        may live on: cancel again until all are gone (each closes its engine as it ends)."""
        for w in self.workers.values():
            w.stop()
        _, stuck = await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_s + 1)
        while stuck:
            for t in stuck:
                t.cancel()
            _, stuck = await asyncio.wait(stuck, timeout=POLL_S)


async def _publish_card(client: aioredis.Redis, keys: Keys, name: str, engine: SimEngine) -> None:
    """What a worker of `name` writes when it starts (see Worker._prepare)."""
    engine.card.name = name
    card = {"card": engine.card.model_dump_json(), "tokenizer": engine.tokenizer_json}
    await client.hset(keys.model_card(name), mapping=card)  # type: ignore[misc,arg-type]
    await client.sadd(keys.models(), name)  # type: ignore[misc]


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenqServer]:
    llama_file = tmp_path_factory.mktemp("templates") / "llama3.jinja"
    llama_file.write_text(LLAMA3)
    base = Settings(
        redis_url=REDIS_URL,
        key_prefix=test_prefix(),
        api_keys=[API_KEY, OTHER_KEY],
        openai_max_queue_depth=QUEUE_LIMIT,
        sim_step_ms=1.0,
        heartbeat_s=0.2,
        lease_s=1.0,
        claim_block_ms=200,
        shutdown_grace_s=0.5,
    )

    def worker(
        template: str | None = None, step_ms: float = 1.0, max_batch: int = base.max_batch
    ) -> tuple[Settings, SimEngine]:
        settings = Settings(**{**base.model_dump(), "chat_template": template})
        # No template of the engine's own: each model's is the one its settings name.
        engine = SimEngine(step_ms=step_ms, max_batch=max_batch, chat_template=None)
        return settings, engine

    genq = GenqServer(
        base,
        {
            CHAT: worker(CHATML),
            LLAMA: worker(str(Path(llama_file))),
            BARE: worker(),
            SLOW: worker(CHATML, step_ms=SLOW_STEP_MS, max_batch=SLOW_BATCH),
            GONE: worker(),
            TOOLS: (Settings(**base.model_dump()), SimEngine(step_ms=1.0)),
        },
    )
    genq.start()
    yield genq
    genq.stop()


@pytest.fixture
def client(server: GenqServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(server: GenqServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="package")
def db(server: GenqServer) -> Iterator[redis.Redis]:
    """A plain Redis client for looking behind the API (job records, queues)."""
    with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
        yield r


def wait_until(predicate: Callable[[], object], within: float, what: str = "") -> float:
    """Seconds until `predicate()` held; fails after `within` seconds. For state owned by
    another thread or process, which offers no event to await."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within:
            raise AssertionError(f"not within {within}s: {what}")
        time.sleep(0.005)
    return time.monotonic() - start


def job_spec(db: redis.Redis, keys: Keys, job_id: str) -> JobSpec:
    return JobSpec.model_validate_json(str(db.hget(keys.job(job_id), "spec")))


async def async_wait_until(predicate: Callable[[], object], within: float, what: str = "") -> float:
    """`wait_until` that lets this thread's event loop run meanwhile."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start
