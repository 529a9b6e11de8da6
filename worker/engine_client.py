"""The worker's link to its engine process (worker/engine_process.py): starts it, sends it
commands, reads one Step message per engine step on the event loop, and restarts it when it
dies or stalls.

A dead or stalled engine is a worker failure, handled as a failed step is: every job the
engine held ends its attempt with an error (handed back, the attempt counted — a job that
crashes or hangs the engine must reach its dead letter like one that fails its step), jobs
already stopped by the worker end as stopped, and the failure counts toward the worker's
limit of consecutive engine failures (it stops, unhealthy, past it). Meanwhile `down` says
why it cannot take jobs: the claim loop claims nothing, readiness reports it, the heartbeat
carries it; claims not started yet go back to the queue (worker/service.py). A stall is no
Step message for GENQ_ENGINE_STALL_S while it holds jobs: the process is killed, then
handled as dead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import cast

from shared import logs
from shared.schemas import ModelCard
from shared.settings import EngineSettings, LogFormat, WorkerSettings
from worker.admission import Admission
from worker.engine import EngineJob, StepOutput, Stop
from worker.link import EngineLink
from worker.wire import (
    Cancel,
    Close,
    Failed,
    FrameError,
    Frames,
    FromEngine,
    Hello,
    Init,
    Step,
    add_message,
    frame,
    from_engine,
)

log = logging.getLogger(__name__)
ENGINE_MODULE = "worker.engine_process"
STOP_TIMEOUT_S = 5.0
"""How long a closed engine process has to exit before it is killed."""
REAP_TIMEOUT_S = 1.0
"""How long an engine process whose socket closed has to exit before it is killed."""
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
STALL_CHECKS = 4
"""Stall checks per GENQ_ENGINE_STALL_S."""


class EngineStartError(RuntimeError):
    """The engine process could not load its engine, or died before saying Hello."""


class _Connection(asyncio.Protocol):
    """The worker's end of the socket: frames in, each message to the current handler."""

    def __init__(self) -> None:
        self._frames = Frames(from_engine)
        self.transport: asyncio.Transport | None = None
        self.first: asyncio.Future[Hello] = asyncio.get_running_loop().create_future()
        self.on_step: Callable[[Step], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except (FrameError, ValueError) as exc:  # msgspec's DecodeError is a ValueError
            log.error("unreadable message from the engine process", extra={"error": str(exc)})
            assert self.transport is not None
            self.transport.abort()
            return
        for m in messages:
            self._handle(m)

    def _handle(self, m: FromEngine) -> None:
        if isinstance(m, Step):
            if self.on_step is not None:
                self.on_step(m)
        elif not self.first.done():
            if isinstance(m, Hello):
                self.first.set_result(m)
            elif isinstance(m, Failed):
                self.first.set_exception(EngineStartError(m.error))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.first.done():
            self.first.set_exception(EngineStartError("the engine process exited while loading"))
        if self.on_lost is not None:
            self.on_lost()


class _Child:
    """One engine process and its socket."""

    def __init__(self, proc: asyncio.subprocess.Process, conn: _Connection, hello: Hello) -> None:
        self.proc = proc
        self.conn = conn
        self.hello = hello

    @classmethod
    async def start(cls, settings: WorkerSettings) -> _Child:
        """Start an engine process and wait for its Hello (its model loaded)."""
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                ENGINE_MODULE,
                "--fd",
                str(theirs.fileno()),
                "--parent",
                str(os.getpid()),
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        try:
            loop = asyncio.get_running_loop()
            transport, conn = await loop.create_unix_connection(_Connection, sock=ours)
            conn.transport = transport  # uvloop may call connection_made only later
            transport.write(frame(_init(settings)))
            hello = await conn.first
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            ours.close()
            raise
        log.info("engine process started", extra={"pid": proc.pid})
        return cls(proc, conn, hello)

    def send(self, data: bytes) -> None:
        if self.conn.transport is not None and not self.conn.lost:
            self.conn.transport.write(data)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def reap(self) -> str:
        """Wait for a process whose socket closed (killing it if it lingers); how it ended."""
        try:
            code = await asyncio.wait_for(self.proc.wait(), REAP_TIMEOUT_S)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
            return "closed its socket"
        finally:
            if self.conn.transport is not None:
                self.conn.transport.close()
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    async def close(self) -> None:
        """Ask it to leave; kill it if it has not within `STOP_TIMEOUT_S`."""
        self.send(frame(Close()))
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("engine process did not exit; killing it", extra={"pid": self.proc.pid})
            self.kill()
            await self.proc.wait()
        if self.conn.transport is not None:
            self.conn.transport.close()


def _init(settings: WorkerSettings) -> Init:
    return Init(
        settings=settings.model_dump_json(include=set(EngineSettings.model_fields)),
        gc_in_steps=settings.engine_gc_in_steps,
        log_level=settings.log_level,
        # `auto` decided as this process decided it (both write to the same stderr).
        log_format=cast(LogFormat, logs.resolve_format(settings.log_format)),
    )


class EngineProcess(EngineLink):
    @classmethod
    async def spawn(cls, settings: WorkerSettings) -> EngineProcess:
        """Start the engine process; returns once its model is loaded."""
        return cls(settings, await _Child.start(settings))

    def __init__(self, settings: WorkerSettings, child: _Child) -> None:
        hello = child.hello
        admission = Admission(
            hello.max_batch,
            hello.page_size,
            hello.total_pages,
            hello.free_pages,
            hello.reserved_tokens,
        )
        card = ModelCard.model_validate_json(hello.card)
        super().__init__(card, hello.tokenizer, admission, settings.detokenize == "worker")
        self.prefill_side_by_side = hello.prefill_side_by_side
        self._settings = settings
        self._child: _Child | None = None
        self._outbox: collections.deque[StepOutput] = collections.deque()
        self._woken = False
        self._held: dict[str, tuple[int, Stop | None]] = {}
        """Jobs in the engine: their attempt, and the stop sent for it if any."""
        self._last_message = time.monotonic()
        self._last_step: float | None = None
        self._stalled: str | None = None
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._frames: list[bytes] = []
        """Commands of this turn of the event loop, written together at its end."""
        self._attach(child)

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._tasks.append(loop.create_task(self._watch(), name="engine-watch"))

    async def aclose(self) -> None:
        self._closing = True
        self._flush_commands()  # what this turn sent goes before the Close
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._child is not None:
            await self._child.close()
            self._child = None

    def _attach(self, child: _Child) -> None:
        self._child = child
        child.conn.on_step = self._on_step
        child.conn.on_lost = lambda: self._on_lost(child)
        if child.conn.lost:  # died between its Hello and now
            asyncio.get_running_loop().call_soon(self._on_lost, child)

    # ---- commands -----------------------------------------------------------------------

    def _send_add(self, job: EngineJob, attempt: int, limit: int) -> None:
        if self._child is None:  # died since the claim loop admitted it: fails like its peers
            self._deliver([StepOutput(job.id, error=f"the engine {self.down}", attempt=attempt)])
            return
        if not self._held:
            self._last_message = time.monotonic()  # a stall is counted from the engine's work
        self._held[job.id] = (attempt, None)
        self._write(frame(add_message(job, attempt, limit)))

    def _send_cancel(self, job_id: str, attempt: int, stop: Stop) -> None:
        held = self._held.get(job_id)
        if self._child is None or held is None or held[0] != attempt:
            return
        self._held[job_id] = (attempt, stop)
        self._write(frame(Cancel(job_id, attempt, stop)))

    def _write(self, data: bytes) -> None:
        """Send a command at the end of this turn of the event loop, with the others of the
        turn in one write: the jobs a claim round starts reach the engine process together,
        and it adds them all before its next step (it reads whatever has arrived, whole
        frames, before stepping), as a bare loop enqueues a burst at once."""
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush_commands)
        self._frames.append(data)

    def _flush_commands(self) -> None:
        data, self._frames = b"".join(self._frames), []
        if self._child is not None and data:
            self._child.send(data)

    def _take(self) -> list[StepOutput]:
        self._woken = False
        out = list(self._outbox)
        self._outbox.clear()
        return out

    def _deliver(self, outputs: list[StepOutput]) -> None:
        self._outbox.extend(outputs)
        if not self._woken:
            self._woken = True
            self._wake()

    # ---- messages -----------------------------------------------------------------------

    def _on_step(self, m: Step) -> None:
        now = time.monotonic()
        self._last_message = now
        self.admission.report(m.free_pages, m.adds)
        self.engine_free_slots = m.free_slots
        if m.steps:
            self._count_steps(m, now)
        held = self._held
        tokens = 0
        for o in m.outputs:
            tokens += len(o.token_ids)
            if o.finish_reason is not None or o.error is not None or o.stopped is not None:
                h = held.get(o.job_id)
                if h is not None and h[0] == o.attempt:
                    del held[o.job_id]
        self.tokens += tokens
        if m.outputs:
            self._deliver(m.outputs)

    def _count_steps(self, m: Step, now: float) -> None:
        t = self.times
        t.steps += m.steps
        t.engine_s += m.step_s
        if self._last_step is not None and not m.waited:
            t.interval(m.steps, now - self._last_step)
        self._last_step = now
        self.failures = self.failures + 1 if m.failures else 0

    # ---- death, stalls, restarts ------------------------------------------------------------

    def _on_lost(self, child: _Child) -> None:
        if child is not self._child or self._closing:
            return
        self._child = None
        self._frames.clear()  # commands for the dead process: its jobs end with it
        self.down = "process lost; restarting it"
        self.failures += 1
        held, self._held = self._held, {}
        self._forget_streams()
        self._last_step = None
        self.changed.set()
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.get_running_loop().create_task(self._lost(child, held)))

    async def _lost(self, dead: _Child, held: dict[str, tuple[int, Stop | None]]) -> None:
        """End the dead process's jobs (stopped ones as stopped, the rest with an error:
        handed back), then start another."""
        stalled, self._stalled = self._stalled, None
        status = await dead.reap()
        how = stalled or status
        self.down = f"process {how}; restarting it"
        log.error(
            "engine process lost; its jobs go back to the queue",
            extra={"pid": dead.proc.pid, "how": how, "jobs": len(held)},
        )
        error = f"the engine process {how}"
        self._deliver(
            [
                StepOutput(job_id, attempt=attempt, stopped=stop)
                if stop is not None
                else StepOutput(job_id, error=error, attempt=attempt)
                for job_id, (attempt, stop) in held.items()
            ]
        )
        await self._restart()

    async def _restart(self) -> None:
        backoff = RESTART_BACKOFF_S
        while not self._closing:
            await asyncio.sleep(backoff)
            try:
                child = await _Child.start(self._settings)
            except (EngineStartError, OSError) as exc:  # OSError: could not even be spawned
                self.failures += 1
                self.down = f"could not be restarted: {exc}; retrying"
                log.error("engine process restart failed", extra={"error": str(exc)})
                self._deliver([])  # the flush loop checks the failure count
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
                continue
            self.admission.restart(child.hello.free_pages)
            self.restarts += 1
            self.down = None
            self._attach(child)
            self.changed.set()
            log.info("engine process restarted", extra={"pid": child.proc.pid})
            return

    async def _watch(self) -> None:
        """Kill an engine process that holds jobs and has sent nothing for too long."""
        stall_s = self._settings.engine_stall_s
        while not self._closing:
            await asyncio.sleep(stall_s / STALL_CHECKS)
            child = self._child
            silent = time.monotonic() - self._last_message
            if child is None or not self._held or silent < stall_s:
                continue
            self._stalled = f"stalled: no step for {silent:.1f} s with {len(self._held)} jobs"
            log.error("engine process stalled; killing it", extra={"pid": child.proc.pid})
            child.kill()
