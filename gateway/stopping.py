"""A gateway process's stop: every open job stream ends with an end event, whatever stops it.

At the first SIGTERM or SIGINT uvicorn closes the listening socket and waits for the open
connections; new requests on kept-alive connections get a 503, and the job streams go on for
the grace (`GENQ_SHUTDOWN_GRACE_S`): a stream whose job ends meanwhile ends with its own final
event. When the grace runs out, or at once on the same signal again (a second Ctrl-C, a second
SIGTERM), every stream still open ends with a `server_stopping` end, written before its
connection closes (native: an `error` event saying whether the job resumes; OpenAI: an error
object, then `[DONE]`; gateway/streaming.py writes it). uvicorn's own graceful timeout is set
past the grace and the end's write (`uvicorn_timeout_s`), so that it never cuts a stream first.

The signals: uvicorn installs its handlers before the app's lifespan starts, and the lifespan
of a gateway started from genq's command line wraps them (`watch_signals`). The first signal
goes on to uvicorn too (it stops accepting); the same signal again does not (uvicorn would stop
waiting and cut the streams without their end); one after that does (a stop that hangs still
ends). A signal of the other kind in between (a terminal's Ctrl-C reaching a process that its
supervisor then sends SIGTERM) is the same stop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

END_WRITE_S = 1.0
"""How long a stream's `server_stopping` end may take to write: a client that does not read
does not hold the stop."""
UVICORN_MARGIN_S = 2 * END_WRITE_S
"""uvicorn's graceful timeout is the grace plus this: the ends are written within it."""
_SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def uvicorn_timeout_s(grace_s: float) -> int:
    """uvicorn's `timeout_graceful_shutdown` for a gateway whose grace is `grace_s`."""
    return math.ceil(grace_s + UVICORN_MARGIN_S)


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class Stopping:
    """The stop of one gateway process: `begin` (its first signal), then `end` (the grace
    over, or the same signal again), each once. Job streams `hold` it while they are open."""

    def __init__(self, grace_s: float, say: Callable[[str], None] | None = None) -> None:
        self.grace_s = grace_s
        self.say: Callable[[str], None] = say or log.info
        """Where the stop is told in words (a log line; `genq serve` prints it)."""
        self.began = False
        self.ended = False
        self._ended = asyncio.Event()
        self._streams: set[Callable[[], None]] = set()
        self._on_begin: list[Callable[[], None]] = []
        self._on_end: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._signals: set[int] = set()
        self._hurried = False
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def ending_streams(self) -> bool:
        """Open streams are being ended (`end`, or `close` at shutdown)."""
        return self._ended.is_set()

    async def wait_end(self) -> None:
        """Until the streams are to end."""
        await self._ended.wait()

    def on_begin(self, listener: Callable[[], None]) -> None:
        self._on_begin.append(listener)

    def on_end(self, listener: Callable[[], None]) -> None:
        self._on_end.append(listener)

    def hold(self, end: Callable[[], None]) -> Callable[[], None]:
        """An open stream, ended by `end()` when the stop ends (at once if it has); the
        function returned lets go of it."""
        if self._ended.is_set():
            end()
            return lambda: None
        self._streams.add(end)
        return lambda: self._streams.discard(end)

    def begin(self, signum: int | None = None) -> None:
        """The stop begins: the streams get the grace, then `end`."""
        if self.began:
            return
        self.began = True
        self._timer = asyncio.get_running_loop().call_later(self.grace_s, self.end, False)
        n = self.open_streams
        if n:
            again = _SIGNAL_NAMES.get(signum or signal.SIGTERM, "the signal")
            jobs = "its job" if n == 1 else "their jobs"
            self.say(
                f"stopping: waiting up to {self.grace_s:g} s for {_plural(n, 'open stream')} "
                f"to end with {jobs}; {again} again to stop now"
            )
        else:
            again = _SIGNAL_NAMES.get(signum or signal.SIGTERM, "the signal")
            self.say(f"stopping: no open streams; {again} again to stop now")
        for listener in self._on_begin:
            listener()

    def end(self, now: bool = True) -> None:
        """Every open stream ends now with its `server_stopping` end. `now`: asked for (the
        same signal again), not the grace running out."""
        if self.ended:
            return
        self.began = self.ended = True
        if self._timer is not None:
            self._timer.cancel()
        n = self.open_streams
        if n:
            why = "stopping now" if now else f"the {self.grace_s:g} s grace is over"
            self.say(f"{why}: ending {_plural(n, 'open stream')} with `server_stopping`")
        self._close_streams()
        for listener in self._on_end:
            listener()

    def close(self) -> None:
        """The server has stopped serving (the lifespan's end): a stream still open ends now.
        Not the stop's end: what else waits for the grace (a worker's jobs) still has it."""
        if self._streams:
            self.say(f"stopping: ending {_plural(self.open_streams, 'open stream')} at shutdown")
        self._close_streams()

    def _close_streams(self) -> None:
        self._ended.set()
        for end in list(self._streams):
            end()

    # ---- signals ----------------------------------------------------------------------------

    def watch_signals(self) -> None:
        """Take SIGINT and SIGTERM, over the handlers installed now (uvicorn's), from the
        running loop's thread (the main one: elsewhere, nothing is done)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in _SIGNAL_NAMES:
            self._previous[sig] = signal.signal(sig, self._signalled)

    def unwatch_signals(self) -> None:
        """Give the handlers back, where they are still this object's."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._signalled:
                signal.signal(sig, previous)
        self._previous.clear()

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        """A Python signal handler: it runs between two bytecodes of the loop's thread, so it
        only schedules what the loop does."""
        assert self._loop is not None
        forward = False
        if not self._signals:
            self._loop.call_soon_threadsafe(self.begin, signum)
            forward = True
        elif signum in self._signals and not self._hurried:
            self._hurried = True
            self._loop.call_soon_threadsafe(self.end)
        elif self._hurried:
            forward = True
        self._signals.add(signum)
        previous = self._previous.get(signum)
        if forward and callable(previous):
            previous(signum, frame)
