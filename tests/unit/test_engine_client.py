"""The worker's end of its engine process: the commands of one turn of the event loop (the
jobs a claim round starts, and cancels) go out in one write, in order, so the engine process
adds them all before its next step, as a bare loop enqueues a burst at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shared.schemas import Sampling
from shared.settings import Settings
from worker.engine import EngineJob, Stop
from worker.engine_client import EngineProcess
from worker.sim import SimEngine
from worker.wire import Add, Cancel, Frames, Hello, to_engine


def link() -> tuple[EngineProcess, list[bytes]]:
    engine = SimEngine()
    hello = Hello(
        card=engine.card.model_dump_json(),
        tokenizer=engine.tokenizer_json,
        max_batch=64,
        page_size=0,
        total_pages=0,
        free_pages=0,
        pid=1,
    )
    writes: list[bytes] = []
    conn = SimpleNamespace(lost=False, on_step=None, on_lost=None)
    child = SimpleNamespace(hello=hello, conn=conn, send=writes.append, proc=SimpleNamespace(pid=1))
    return EngineProcess(Settings(), child), writes  # type: ignore[arg-type]


async def test_a_turns_commands_go_out_in_one_write_in_order() -> None:
    p, writes = link()
    for i in range(32):
        p.add(EngineJob(f"j{i}", [5, 6, 7], 8, Sampling(), i), attempt=1)
    p.cancel("j3", 1, Stop("cancelled"))
    assert writes == []  # at the end of the turn
    await asyncio.sleep(0)
    [data] = writes
    messages = Frames(to_engine).feed(data)
    assert [m.job_id for m in messages if isinstance(m, Add)] == [f"j{i}" for i in range(32)]
    assert isinstance(messages[-1], Cancel) and messages[-1].job_id == "j3"
    p.add(EngineJob("late", [5], 8, Sampling(), 1), attempt=1)  # the next turn: a write of its own
    await asyncio.sleep(0)
    assert len(writes) == 2
