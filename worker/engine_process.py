"""The engine process: `python -m worker.engine_process --fd N`, started by its worker (see
worker/engine_client.py), which passes it one end of a socketpair as file descriptor N.

One thread, no asyncio, no Redis: it builds the engine, says Hello, then loops — take the
commands that have arrived (waiting for one only while no job is active), apply them, step
the engine once, send one Step message with every output of that step and the engine's free
pages (steps quicker than `COALESCE_S` share one). Messages are worker/wire.py's.

It ignores SIGINT and SIGTERM (a terminal's Ctrl-C or systemd's stop reach the whole process
group; the worker drains first and then closes its engine) and exits when the worker's end
of the socket closes, or with the worker itself (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import time

from shared import lifeline, logs
from shared.settings import EngineSettings, RedisSettings
from worker import cpus
from worker.core import AddCommand, CancelCommand, Command, EngineCore
from worker.engine import Engine, StepOutput, prefill_side_by_side, reserved_tokens
from worker.engines import build_engine
from worker.wire import Add, Cancel, Channel, Close, Failed, Hello, Init, Step, ToEngine, engine_job

log = logging.getLogger(__name__)
COALESCE_S = 0.001
"""Steps quicker than this go out in one message, at most this late. A GPU step takes longer
(a message each); the sim's at `--step-ms 0` far less, and a message per step of a few tokens
would cost the worker a wake-up each (measured: docs/performance.md, "The engine process")."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.engine_process")
    p.add_argument("--fd", type=int, required=True, help="this end of the worker's socketpair")
    p.add_argument("--parent", type=int, help="the worker's pid (default: this one's parent)")
    args = p.parse_args(argv)
    _detach_from_signals(os.getppid() if args.parent is None else args.parent)
    channel = Channel(socket.socket(fileno=args.fd))
    first = channel.receive(wait=True)
    if not first or not isinstance(first[0], Init):
        return 1
    init = first[0]
    logs.setup(RedisSettings(log_level=init.log_level, log_format=init.log_format))
    try:
        settings = EngineSettings.model_validate_json(init.settings)
        pinned = cpus.apply(settings.engine_cpus)  # before torch loads
        if pinned is not None:
            log.info("engine pinned to CPUs", extra={"cpus": settings.engine_cpus})
        engine = build_engine(settings)
    except (Exception, SystemExit) as exc:
        log.exception("engine could not be built")
        channel.send(Failed(str(exc) or type(exc).__name__))
        return 1
    # Everything loaded so far (the model, the tokenizer, the modules) lives as long as the
    # process: never scanned by the collector again.
    gc.collect()
    gc.freeze()
    try:
        channel.send(_hello(engine))
        serve(channel, engine, init.gc_in_steps, first[1:], settings.step_profile_s)
    except (BrokenPipeError, ConnectionError):
        pass  # the worker is gone
    finally:
        engine.close()
    return 0


def _hello(engine: Engine) -> Hello:
    return Hello(
        card=engine.card.model_dump_json(),
        tokenizer=engine.tokenizer_json,
        max_batch=engine.max_batch,
        page_size=engine.page_size,
        total_pages=engine.total_pages,
        free_pages=engine.free_pages(),
        pid=os.getpid(),
        reserved_tokens=reserved_tokens(engine),
        prefill_side_by_side=prefill_side_by_side(engine),
    )


class _Outbox:
    """The Step message being put together: one step's, or a few quick ones' (`COALESCE_S`)."""

    def __init__(self, channel: Channel, engine: Engine, core: EngineCore) -> None:
        self._channel = channel
        self._engine = engine
        self._core = core
        self._outputs: list[StepOutput] = []
        self._steps = 0
        self._step_s = 0.0
        self._waited = True
        self._pending = False
        self._sent_at = 0.0

    def add(self, outputs: list[StepOutput], stepped: bool) -> None:
        self._outputs += outputs
        if stepped:
            self._steps += 1
            self._step_s += self._core.last_step_s
        self._pending = True

    def waited(self) -> None:
        """The engine had no job and waits for commands."""
        self._waited = True

    def send(self, now: bool) -> None:
        """Send what is pending: `now`, or once `COALESCE_S` has passed since the last send."""
        at = time.perf_counter()
        if not self._pending or (not now and at - self._sent_at < COALESCE_S):
            return
        engine, core = self._engine, self._core
        self._channel.send(
            Step(
                outputs=self._outputs,
                free_pages=engine.free_pages(),
                free_slots=engine.max_batch - engine.active(),
                adds=core.adds,
                steps=self._steps,
                step_s=self._step_s,
                failures=core.failures,
                waited=self._waited,
            )
        )
        self._outputs, self._steps, self._step_s = [], 0, 0.0
        self._waited = self._pending = False
        self._sent_at = at


class _Profile:
    """GENQ_STEP_PROFILE_S: every `every_s` seconds of stepping, one log line of the steps
    since the last one, with the engine's own counters (`profile()`, where it has one:
    genq's hook on the GPU engines), as differences."""

    def __init__(self, engine: Engine, every_s: float) -> None:
        self._engine = engine
        self._every_s = every_s
        self._counters = getattr(engine, "profile", None)
        self._last: dict[str, float | int] = self._read()
        self._at = time.perf_counter()
        self._steps = 0
        self._step_s = 0.0
        self._tokens = 0

    def _read(self) -> dict[str, float | int]:
        return dict(self._counters()) if callable(self._counters) else {}

    def stepped(self, core: EngineCore, outputs: list[StepOutput]) -> None:
        self._steps += 1
        self._step_s += core.last_step_s
        self._tokens += sum(len(o.token_ids) for o in outputs)
        now = time.perf_counter()
        if now - self._at < self._every_s:
            return
        counters = self._read()
        delta = {k: round(v - self._last.get(k, 0), 6) for k, v in counters.items()}
        log.info(
            "engine profile",
            extra={
                "seconds": round(now - self._at, 3),
                "steps": self._steps,
                "step_ms": round(self._step_s / self._steps * 1000, 3),
                "tokens": self._tokens,
                **delta,
            },
        )
        self._last, self._at = counters, now
        self._steps, self._step_s, self._tokens = 0, 0.0, 0


def serve(
    channel: Channel,
    engine: Engine,
    gc_in_steps: bool,
    early: list[ToEngine],
    profile_s: float = 0.0,
) -> None:
    """Until Close or the worker's end closes: commands in, one step, its message out."""
    core = EngineCore(engine)
    outbox = _Outbox(channel, engine, core)
    profile = _Profile(engine, profile_s) if profile_s > 0 else None
    if not gc_in_steps:
        gc.disable()
    garbage = False
    received: list[ToEngine] | None = early
    while True:
        if received is None:
            busy = engine.active() > 0 or core.waiting() > 0
            if not busy:
                outbox.send(now=True)  # before waiting: nothing may stay behind
                outbox.waited()
                if garbage:  # collect while nothing waits on this process
                    gc.collect()
                    garbage = False
            received = channel.receive(wait=not busy)
            if received is None:
                return
        commands = _commands(received)
        if commands is None:
            return
        received = None
        outputs = core.apply(commands)
        stepped = engine.active() > 0
        if stepped:
            stepped_out = core.step()
            outputs += stepped_out
            garbage = not gc_in_steps
            if profile is not None:
                profile.stepped(core, stepped_out)
        if commands or stepped:
            outbox.add(outputs, stepped)
        outbox.send(now=engine.active() == 0)


def _commands(received: list[ToEngine]) -> list[Command] | None:
    """The core's commands; None on Close."""
    out: list[Command] = []
    for m in received:
        if isinstance(m, Add):
            out.append(AddCommand(engine_job(m), m.attempt, m.limit))
        elif isinstance(m, Cancel):
            out.append(CancelCommand(m.job_id, m.attempt, m.stop))
        elif isinstance(m, Close):
            return None
    return out


def _detach_from_signals(worker: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Dies with the worker even while loading a model (when it reads no socket); SIGKILL, as
    # SIGTERM is ignored. The worker forks it from its event loop's thread, which lives as
    # long as the worker.
    lifeline.die_with_parent(worker, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
