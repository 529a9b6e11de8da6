"""`shared.loops.keep_running`: the background loops' "Redis failed: log, pause, go on"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError, ResponseError

from shared import loops
from shared.loops import keep_running

log = logging.getLogger("tests.loops")
REAL_SLEEP = asyncio.sleep


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every pause the loop takes, in order, among the steps (written "step")."""
    taken: list[object] = []

    async def sleep(seconds: float) -> None:
        taken.append(seconds)
        await REAL_SLEEP(0)

    monkeypatch.setattr(loops.asyncio, "sleep", sleep)
    yield taken


def test_a_redis_failure_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture, pauses: list[object]
) -> None:
    steps: list[int] = []
    seen: list[Exception] = []
    failures = [ConnectionError("refused"), OSError("reset"), ResponseError("NOGROUP gone")]

    async def step() -> None:
        steps.append(len(steps))
        pauses.append("step")
        if failures:
            raise failures.pop(0)

    async def on_failure(exc: Exception) -> None:
        seen.append(exc)

    caplog.set_level(logging.DEBUG, logger="tests.loops")
    asyncio.run(
        keep_running(
            step,
            failed="probe failed",
            log=log,
            every_s=0.01,
            retry_s=0.05,
            running=lambda: len(steps) < 5,
            on_failure=on_failure,
        )
    )
    assert len(steps) == 5 and [str(e) for e in seen] == ["refused", "reset", "NOGROUP gone"]
    lines = [r for r in caplog.records if r.name == "tests.loops"]
    assert [(r.levelno, r.getMessage(), r.error) for r in lines] == [  # type: ignore[attr-defined]
        (logging.WARNING, "probe failed", "refused"),
        (logging.WARNING, "probe failed", "reset"),
        (logging.WARNING, "probe failed", "NOGROUP gone"),
    ]
    # every_s before each step; retry_s after a failed one only
    assert pauses == [0.01, "step", 0.05] * 3 + [0.01, "step"] * 2


def test_anything_but_a_redis_failure_ends_the_loop() -> None:
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        asyncio.run(keep_running(step, failed="x", log=log, every_s=0.0))
    assert calls == 1


def test_the_pause_comes_first_or_after_each_step(pauses: list[object]) -> None:
    async def step() -> None:
        pauses.append("step")

    def twice() -> bool:
        return pauses.count("step") < 2

    asyncio.run(keep_running(step, failed="x", log=log, every_s=0.1, running=twice))
    assert pauses == [0.1, "step", 0.1, "step"]
    pauses.clear()
    asyncio.run(
        keep_running(step, failed="x", log=log, every_s=0.1, pause_first=False, running=twice)
    )
    assert pauses == ["step", 0.1, "step", 0.1]


def test_a_sync_failure_hook_is_called_too() -> None:
    seen: list[str] = []
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        raise ConnectionError("down")

    asyncio.run(
        keep_running(
            step,
            failed="x",
            log=log,
            every_s=0.0,
            running=lambda: runs < 2,
            on_failure=lambda exc: seen.append(str(exc)),
        )
    )
    assert seen == ["down", "down"]


async def test_the_gateway_waits_for_every_loop_it_cancels() -> None:
    """At shutdown every background loop has ended before the Redis connections close: one
    that takes a moment to end its cancellation is waited for, not left running (the first
    loop to end must not end the wait)."""
    from gateway.app import _cancel

    ended: list[str] = []

    async def quick() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("quick")

    async def slow() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await REAL_SLEEP(0.05)  # a round trip on its way out
            ended.append("slow")

    tasks = [asyncio.create_task(quick()), asyncio.create_task(slow())]
    await REAL_SLEEP(0)
    await _cancel(tasks)
    assert ended == ["quick", "slow"] and all(t.done() for t in tasks)


async def test_a_cancel_a_client_swallowed_still_ends_the_loop() -> None:
    """A Redis client may swallow a cancel that lands inside a command (fakeredis and
    redis-py 8 do): the loop still ends at its next round instead of running on, which kept
    a gateway's shutdown waiting for ever."""
    inside = asyncio.Event()

    async def step() -> None:
        inside.set()
        try:
            await REAL_SLEEP(0.02)
        except asyncio.CancelledError:
            pass  # what a client that swallows the cancel does

    task = asyncio.create_task(keep_running(step, failed="x", log=log, every_s=0.001))
    await inside.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done, "the loop ran on after its cancel"
    assert task.cancelled()
