"""A gateway's stop (gateway/stopping.py): which signal does what, and what it counts on in
uvicorn (its handlers are installed before the app's lifespan starts)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import uvicorn

from gateway.stopping import Stopping

SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def test_the_first_signal_begins_the_same_again_ends_and_one_more_goes_to_uvicorn() -> None:
    forwarded: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:  # in uvicorn's place
        signal.signal(sig, lambda signum, frame: forwarded.append(signum))
    stopping = Stopping(grace_s=60.0, say=lambda _: None)
    stopping.watch_signals()
    try:
        ended: list[bool] = []
        stopping.on_end(lambda: ended.append(True))
        release = stopping.hold(lambda: ended.append(False))  # an open stream

        signal.raise_signal(signal.SIGINT)  # a terminal's Ctrl-C
        signal.raise_signal(signal.SIGTERM)  # its supervisor's SIGTERM: the same stop
        await asyncio.sleep(0)
        assert stopping.began and not stopping.ended
        assert forwarded == [signal.SIGINT]  # uvicorn stops accepting
        assert stopping.open_streams == 1

        signal.raise_signal(signal.SIGINT)  # Ctrl-C again: the streams end now
        await asyncio.sleep(0)
        assert stopping.ended and ended == [False, True]
        assert forwarded == [signal.SIGINT]  # not to uvicorn: it would cut the streams

        signal.raise_signal(signal.SIGINT)  # one more: a stop that hangs still ends
        assert forwarded == [signal.SIGINT, signal.SIGINT]
        release()
    finally:
        stopping.unwatch_signals()
        for sig, handler in before.items():
            signal.signal(sig, handler)


async def test_a_stream_held_after_the_end_ends_at_once() -> None:
    stopping = Stopping(grace_s=0.0, say=lambda _: None)
    stopping.begin()
    await asyncio.sleep(0.01)  # the grace (none) runs out
    ended: list[bool] = []
    stopping.hold(lambda: ended.append(True))
    assert stopping.ended and ended == [True]


def test_uvicorn_installs_its_signal_handlers_before_the_lifespan_starts() -> None:
    seen: dict[int, Any] = {}
    server: uvicorn.Server

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        await receive()  # startup
        for sig in SIGNALS:
            seen[sig] = signal.getsignal(sig)
        server.should_exit = True
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})

    config = uvicorn.Config(app, port=0, lifespan="on", log_config=None)
    server = uvicorn.Server(config)
    server.run()
    assert seen == {sig: server.handle_exit for sig in SIGNALS}
