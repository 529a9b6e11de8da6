"""A job's events as SSE: replay the log, then follow live, filling any gap from the log.

Frames: `id: <seq>`, `event: <type>`, `data: <event JSON>`; the JSON passes through as the
worker wrote it. Everything buffered when the stream wakes goes out as one write.

Memory per stream is bounded whatever the job's output: the live buffer is bounded in bytes
(`gateway.pubsub`), the log is read a page at a time (`event_page_entries`) and only as fast
as the client takes it, and a client none of whose writes completes for
`stream_stall_timeout_s` is disconnected.

A stream waiting for news costs Redis nothing: it reads only when woken (news, a gap, a
reconnect or a confirmed SUBSCRIBE, see `gateway.pubsub`), after a failed read (retried with
backoff), and once per `stream_idle_poll_s` of silence (jittered), a safety net for changes no
message announces. Every event a job gets is PUBLISHed in the same script that logs it, so
nothing else needs polling; keepalive comments are timed here and cost no Redis either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable

import anyio
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.http_protocol import ABORT_EXTENSION, KEEPALIVE_EXTENSION
from gateway.keepalive import BY_TICKER, KEEPALIVE, Entry, KeepaliveTicker
from gateway.pubsub import Subscription
from gateway.stopping import END_WRITE_S, Stopping
from shared import events
from shared.compact import CompactLog, Envelope
from shared.events import (
    EVENT_FIELD,
    FINAL_EVENT_TYPES,
    SERVER_STOPPING,
    ErrorEvent,
    EventError,
    StartedEvent,
)
from shared.keys import Keys, event_id, seq_of
from shared.records import RecordError, unpack
from shared.schemas import JobResult
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

DIVERGED_CODE = "stream_diverged"
_WORKER_OUTPUT = frozenset({"token", "done"})
"""What an attempt writes only after its `started` (errors and cancels may come without)."""
CHECK_JITTER = 0.5
"""The safety check's wait is `stream_idle_poll_s` times 1 ± this, drawn per wait."""


class EventFollower:
    """Yields a job's events (seq, type, JSON) in order, exactly once each, then stops."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: GatewaySettings,
        sub: Subscription,
        job_id: str,
        after_seq: int = 0,
        ended: Callable[[str, str], None] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.sub = sub
        self.job_id = job_id
        self.last = after_seq
        self.finished = False
        self.attempt: int | None = None
        """Attempt of the last event delivered (None before any: a resume cannot know)."""
        self.diverged = False
        self.log_ahead = False
        """The last log read was a full page: the log may hold more at once."""
        self._page = settings.event_page_entries
        """Entries the next log read asks for (fewer once the events are known to be big)."""
        self.gone = False
        """The job's log is gone (expired, evicted): nothing more can come."""
        self._check_at = 0.0
        """When the stream looks at its log unasked: the safety check, or a failed read's
        retry."""
        self._failures = 0
        """Log reads failed in a row."""
        self.ended = ended
        """Told (job id, worker) when the job's `done` comes: placement's `ended`."""
        self.worker: str | None = None
        """The worker of the last `started` seen (None before one: a resume may not see it)."""

    async def read_log(self) -> list[tuple[int, str, str]]:
        """One page of the events after `last` from the job's log: at most
        `event_page_entries`, and about `stream_buffer_bytes` of them by the sizes read so
        far, so a page of large events (logprobs) held while a slow client takes it costs no
        more than the live buffer would. A finished job's log compacted into its record
        (`shared.compact`) is read from there, a page of the same size at a time."""
        page = self._page
        self.sub.reading()
        entries = await self.redis.xrange(
            self.keys.events(self.job_id), f"({event_id(self.last)}", "+", count=page
        )
        if not entries:  # nothing new, or compacted: the log is gone then
            compacted = await self._read_compacted()
            if compacted is not None:
                return compacted
        accepted = self._accept([_from_log(i, f[EVENT_FIELD]) for i, f in entries])
        self.log_ahead = len(entries) == page and len(accepted) == page
        if entries:
            size = sum(len(f[EVENT_FIELD]) for _, f in entries) or 1
            fits = self.settings.stream_buffer_bytes * len(entries) // size
            self._page = max(1, min(self.settings.event_page_entries, fits))
        return accepted

    async def _compact_log(self) -> tuple[CompactLog, JobResult | None] | None:
        """The job's compact log and result, if its log was compacted (`shared.compact`).
        Read again each time, not kept: it holds the job's whole text."""
        key = self.keys.job(self.job_id)
        log_value = await self.redis.hget(key, "log")  # a running job's read costs no more
        if log_value is None:
            return None
        result = await self.redis.hget(key, "result")
        try:
            compact = CompactLog.decode(log_value)
            return compact, JobResult.model_validate_json(unpack(result)) if result else None
        except (RecordError, ValueError):
            log.error("job's compact log does not decode", extra={"job_id": self.job_id})
            return None

    async def _read_compacted(self) -> list[tuple[int, str, str]] | None:
        """One page of the events after `last` from the job's compact log; None if it has
        none (its log was not compacted)."""
        found = await self._compact_log()
        if found is None:
            return None
        compact, result = found
        s = self.settings
        items, more = compact.replay(
            self.last, result, max_bytes=s.stream_buffer_bytes, max_events=s.event_page_entries
        )
        out = []
        for seq, etype, attempt, data in items:  # one after another by construction
            out.append((seq, etype, data))  # a token event stands for those up to its seq
            self.last, self.attempt = seq, attempt
            self._saw(etype, data)
            if etype in FINAL_EVENT_TYPES:
                self.finished = True
                break
        self.log_ahead = more and not self.finished
        return out

    def _accept(self, items: list[Envelope]) -> list[tuple[int, str, str]]:
        """The run of items that continues `last` without a hole.

        A new attempt begins with its `started` event. Output (a token, its done) of a newer
        attempt than the last one delivered, whose `started` this stream never saw, means the
        attempt began at a seq this stream had already delivered for the old one: Redis lost
        those events (a restart without its last writes) and their writer is gone. What follows
        does not continue what the client has; the stream ends with a `stream_diverged` error
        frame (not from the log) instead."""
        out = []
        for seq, etype, attempt, data in items:
            if seq != self.last + 1:
                break
            if self.attempt is not None and attempt > self.attempt and etype in _WORKER_OUTPUT:
                out.append(self._diverge(attempt))
                break
            out.append((seq, etype, data))
            self.last, self.attempt = seq, attempt
            self._saw(etype, data)
            if etype in FINAL_EVENT_TYPES:
                self.finished = True
                break
        return out

    def _saw(self, etype: str, data: str) -> None:
        """Note who runs the job (`started`); at its `done`, tell `ended`."""
        if etype == "started":
            try:
                ev = events.decode(data)
            except EventError:
                ev = None
            self.worker = ev.worker if isinstance(ev, StartedEvent) else None
        elif etype == "done" and self.ended is not None and self.worker is not None:
            self.ended(self.job_id, self.worker)

    def _diverge(self, attempt: int) -> tuple[int, str, str]:
        log.warning("stream diverged from the job's log", extra={"job_id": self.job_id})
        self.diverged = self.finished = True
        message = (
            f"the job's log lost events this stream had delivered, and attempt {attempt} "
            f"continues from an earlier point; GET /v1/jobs/{self.job_id} has its text"
        )
        ev = ErrorEvent(seq=0, attempt=attempt, code=DIVERGED_CODE, message=message)
        return (0, "error", events.encode(ev))

    async def batches(self) -> AsyncIterator[list[tuple[int, str, str]] | None]:
        """Batches of new events; None after `sse_keepalive_s` without any."""
        self._plan_check()
        backlog = await self._refill()  # Redis away: retried after `stream_retry_s`
        if backlog:
            yield backlog
        elif not self.log_ahead and not await self._open():
            return  # resumed at or past the end of a job that has ended
        # sent by the process's one loop, or by this stream when its server cannot do that
        keepalive_s = math.inf if BY_TICKER.get(False) else self.settings.sse_keepalive_s
        idle_since = time.monotonic()
        while not self.finished:
            batch = await self._next(idle_since + keepalive_s)
            if self.gone:
                return
            if batch:
                idle_since = time.monotonic()
                self._plan_check()
                yield batch
            elif time.monotonic() - idle_since >= keepalive_s:
                idle_since = time.monotonic()
                yield None

    async def _next(self, keepalive_at: float) -> list[tuple[int, str, str]]:
        """The next events: from the log while it is ahead, else live, filling holes; nothing
        once `keepalive_at` passes without news."""
        if self.log_ahead:  # catching up (a resume, or a client that fell behind)
            return await self._refill()
        if not self.sub.wake.is_set():
            try:
                wait = min(keepalive_at, self._check_at) - time.monotonic()
                async with asyncio.timeout(max(0.0, wait)):
                    await self.sub.wake.wait()
            except TimeoutError:
                if time.monotonic() >= self._check_at:
                    return await self._check()
                return []
        if self.sub.behind:  # the client fell behind: what it missed is in the log
            self.sub.take()
            return await self._refill()
        parsed = [_parse(data) for data in self.sub.take()]
        live = [e for e in parsed if e[0] > self.last]
        if live and live[0][0] == self.last + 1:
            batch = self._accept(live)
            if self.last < live[-1][0] and not self.finished:
                batch += await self._refill()  # a hole inside the burst
            return batch
        if live:  # a hole: the log has it
            return await self._refill()
        if not parsed:  # woken without news: messages may have been missed
            return await self._caught_up()
        if any(etype in FINAL_EVENT_TYPES for _, etype, _, _ in parsed):
            self.finished = True  # resumed past the end of a job that has now ended
        return []

    async def _refill(self) -> list[tuple[int, str, str]]:
        try:
            batch = await self.read_log()
        except (RedisError, OSError):
            self._read_failed()
            return []
        self._failures = 0
        return batch

    async def _caught_up(self) -> list[tuple[int, str, str]]:
        """What was missed, from the log; if nothing, whether the log is still there."""
        batch = await self._refill()
        if not batch and not self._failures:  # read, and nothing new: is the log there?
            return await self._check()
        return batch

    async def _check(self) -> list[tuple[int, str, str]]:
        """Whether anything was missed, from the log's last entry (one short read): the log
        is read only if it holds more than was delivered."""
        self._plan_check()
        self.sub.reading()
        try:
            tail = await self.redis.xrevrange(self.keys.events(self.job_id), "+", "-", count=1)
        except (RedisError, OSError):
            self._read_failed()
            return []
        self._failures = 0
        if not tail:  # gone (expired, evicted), or kept in another form `_open` knows of
            if await self._open():
                return await self._refill()
            self.gone = True
            return []
        if seq_of(tail[0][0]) > self.last:
            return await self._refill()
        return []

    def _plan_check(self) -> None:
        jitter = random.uniform(1 - CHECK_JITTER, 1 + CHECK_JITTER)
        self._check_at = time.monotonic() + self.settings.stream_idle_poll_s * jitter

    def _read_failed(self) -> None:
        """Redis away or a read cut short: look again soon, backing off while it fails."""
        self.log_ahead = False
        wait = self.settings.stream_retry_s * 2 ** min(self._failures, _MAX_DOUBLINGS)
        self._check_at = time.monotonic() + min(wait, self.settings.stream_idle_poll_s)
        self._failures += 1

    async def _open(self) -> bool:
        """False once nothing more can come: the job's log is gone (expired), or it ended at
        or before `last` (a client resuming past the end: it gets nothing more, so it ends)."""
        try:
            tail = await self.redis.xrevrange(self.keys.events(self.job_id), "+", "-", count=1)
        except (RedisError, OSError):
            return True  # Redis is away: keep waiting for it
        if not tail:  # expired, or compacted
            return await self._open_compacted()
        entry_id, fields = tail[0]
        try:
            etype = events.peek(fields[EVENT_FIELD])[1]
        except (EventError, KeyError):
            return True
        if etype in FINAL_EVENT_TYPES and seq_of(entry_id) <= self.last:
            self.finished = True
            return False
        return True

    async def _open_compacted(self) -> bool:
        """`_open` for a job whose log is gone: whether its compact log goes on past `last`."""
        try:
            found = await self._compact_log()
        except (RedisError, OSError):
            return True
        if found is None:
            return False
        if found[0].last_seq <= self.last:  # it ended at or before `last`
            self.finished = True
            return False
        return True


_MAX_DOUBLINGS = 16
"""Bounds the retry's exponent (the wait is capped by `stream_idle_poll_s` long before)."""


STOPPED_REASON = "the server stopped while its stream was open"
"""Why a job whose stream's end cancels it is cancelled when the gateway stops."""


def stopped_frame(follower: EventFollower, resumes: bool) -> bytes:
    """A native stream's `server_stopping` end: an `error` event without an `id:` (a resume's
    Last-Event-ID stays the job's last event delivered). `resumes`: the job goes on (else its
    stream's end cancels it)."""
    job_id = follower.job_id
    if resumes:
        then = (
            "the job goes on (when a worker runs it again): follow it with GET "
            f"/v1/jobs/{job_id}/events and Last-Event-ID"
        )
    else:
        then = "the job is cancelled with its stream (cancel_on_disconnect)"
    message = f"the server is stopping before job {job_id} ended; {then}"
    ev = ErrorEvent(
        seq=0, attempt=follower.attempt or 0, code=SERVER_STOPPING, message=message, resumes=resumes
    )
    return sse_frame(0, "error", events.encode(ev)).encode()


_LINE_SEPARATORS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\x85", "\\u0085"))
"""The characters other than CR and LF that `str.splitlines` ends a line at and JSON may hold
unescaped (the rest are control characters, which JSON always escapes), with their escapes."""


def sse_data(json_text: str) -> str:
    """JSON as a `data:` line carries it: U+2028, U+2029 and U+0085 escaped (`\\u2028`, …).
    Clients that split lines as `str.splitlines` does (httpx's `aiter_lines`) break a line at
    them; JSON holds them only inside strings, where the escape means the same character."""
    if json_text.isascii():  # O(1) in CPython: the usual frame costs nothing more
        return json_text
    # three scans first: a fifth of what three replaces cost even when they find nothing
    if "\u2028" in json_text or "\u2029" in json_text or "\x85" in json_text:
        for char, escaped in _LINE_SEPARATORS:
            json_text = json_text.replace(char, escaped)
    return json_text


def sse_frame(seq: int, etype: str, data: str) -> str:
    data = sse_data(data)
    if seq == 0:  # not from the log (stream_diverged, server_stopping): no id to resume from
        return f"event: {etype}\ndata: {data}\n\n"
    return f"id: {seq}\nevent: {etype}\ndata: {data}\n\n"


async def sse_stream(follower: EventFollower) -> AsyncIterator[bytes]:
    async for batch in follower.batches():
        if batch is None:
            yield KEEPALIVE
        else:
            yield "".join(sse_frame(*e) for e in batch).encode()


def _from_log(entry_id: str, data: str) -> Envelope:
    _, etype, attempt = events.envelope(data)
    return seq_of(entry_id), etype, attempt, data


def _parse(data: str) -> Envelope:
    seq, etype, attempt = events.envelope(data)
    return seq, etype, attempt, data


class EventStreamResponse(StreamingResponse):
    """SSE response that notices a client's disconnect at once, even on an idle stream, lets
    go of a client that stopped reading, and ends with an end event when the gateway stops.

    Starlette only races the body against `http.disconnect` for older ASGI spec versions; a
    stream that must cancel its job within a second cannot wait for its next write to fail.
    A write blocks while the client's socket is full: one that cannot complete within
    `stall_timeout_s` ends the stream (its body's cleanup runs, as on a disconnect) and drops
    the connection.

    A job's stream gives `on_stop`: when the gateway's stop ends its streams
    (gateway/stopping.py), the body is stopped (its cleanup runs) and the bytes `on_stop`
    returns are the stream's last, written within `END_WRITE_S`.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        job_id: str | None = None,
        *,
        stall_timeout_s: float,
        on_stop: Callable[[], bytes] | None = None,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if job_id:
            headers["X-Job-Id"] = job_id
        super().__init__(content, headers=headers)
        self.job_id = job_id
        self.stall_timeout_s = stall_timeout_s
        self.on_stop = on_stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stalled = False
        self._ticker: KeepaliveTicker | None
        self._write: Callable[[bytes], bool] | None
        self._ticker, self._write = _keepalive_ticker(scope)
        if self._ticker is not None:
            BY_TICKER.set(True)  # the body's task and the followers' see it (copied contexts)
        stopping = _stopping(scope) if self.on_stop is not None else None
        async with anyio.create_task_group() as tg:

            async def body() -> None:
                nonlocal stalled
                with contextlib.suppress(OSError):
                    stalled = not await self._stream(send, stopping)
                tg.cancel_scope.cancel()

            tg.start_soon(body)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        if stalled:
            log.warning(
                "client stopped reading its stream; disconnecting it",
                extra={"job_id": self.job_id, "stall_timeout_s": self.stall_timeout_s},
            )
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION, {}).get("abort")
            if abort is not None:  # else the server closes it once the client reads
                abort()

    async def _stream(self, send: Send, stopping: Stopping | None) -> bool:
        """Starlette's `stream_response`, each write bounded in time: False if one stalled.
        Keepalive comments come from the process's loop where there is one (`_ticker`)."""
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        entry = self._register()
        try:
            with anyio.CancelScope() as pumping:
                release = stopping.hold(pumping.cancel) if stopping is not None else None
                try:
                    if not await self._pump(send, entry):
                        return False
                finally:
                    if release is not None:
                        release()
            last = b""
            write_s = self.stall_timeout_s
            if pumping.cancelled_caught and self.on_stop is not None:
                await self._close_body()  # its cleanup first: a job it cancels is cancelled
                last, write_s = self.on_stop(), END_WRITE_S
            try:
                with anyio.fail_after(write_s):
                    if last:
                        await send({"type": "http.response.body", "body": last, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except TimeoutError:
                return False
            return True
        finally:
            if entry is not None and self._ticker is not None:
                self._ticker.remove(entry)
            await self._close_body()

    async def _pump(self, send: Send, entry: Entry | None) -> bool:
        """The body's chunks to the client: False if a write stalled."""
        async for chunk in self.body_iterator:
            data = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            if entry is not None:
                if data == KEEPALIVE:
                    continue
                entry.last = time.monotonic()
            try:
                with anyio.fail_after(self.stall_timeout_s):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            except TimeoutError:
                return False
        return True

    async def _close_body(self) -> None:
        """The body's cleanup now, not when it is collected."""
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()

    def _register(self) -> Entry | None:
        if self._ticker is None or self._write is None:
            return None
        return self._ticker.add(self._write)


def _stopping(scope: Scope) -> Stopping | None:
    """The app's stop (gateway/stopping.py), if it has one."""
    stopping = getattr(getattr(scope.get("app"), "state", None), "stopping", None)
    return stopping if isinstance(stopping, Stopping) else None


def _keepalive_ticker(
    scope: Scope,
) -> tuple[KeepaliveTicker, Callable[[bytes], bool]] | tuple[None, None]:
    """The app's keepalive loop and the server's writer of this stream's chunks, if the
    server has one (genq's protocol); else (None, None): the stream sends its own."""
    app = scope.get("app")
    ticker = getattr(getattr(app, "state", None), "keepalives", None)
    extension = scope.get("extensions", {}).get(KEEPALIVE_EXTENSION)
    if not isinstance(ticker, KeepaliveTicker) or extension is None:
        return None, None
    return ticker, extension["write"]
