"""The engine process's messages: framed across any split of the stream, decoded only into
their own types, jobs carried whole."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest

from shared.schemas import Sampling
from worker.engine import EngineJob, StepOutput, Stop
from worker.wire import (
    MAX_FRAME_BYTES,
    Add,
    Cancel,
    Close,
    FrameError,
    Frames,
    SamplingWire,
    Step,
    add_message,
    engine_job,
    frame,
    from_engine,
    to_engine,
)


def _step(n: int) -> Step:
    outs = [
        StepOutput(f"job{i}", text=f" w{i}", token_ids=[i, i + 1], attempt=2, prompt_tokens=9)
        for i in range(n)
    ]
    outs.append(StepOutput("done", finish_reason="length", stopped=Stop("cancelled", "bye")))
    return Step(
        outs, free_pages=3, free_slots=4, adds=5, steps=2, step_s=0.01, failures=0, waited=False
    )


def test_frames_survive_any_split_of_the_stream() -> None:
    messages = [_step(n) for n in (0, 1, 50)]
    data = b"".join(frame(m) for m in messages)
    rng = random.Random(1)
    for _ in range(20):
        frames = Frames(from_engine)
        got: list = []
        at = 0
        while at < len(data):
            n = rng.choice([1, 2, 7, 100, 5000])
            got += frames.feed(data[at : at + n])
            at += n
        assert got == messages


def test_a_frame_announcing_more_than_the_limit_is_refused() -> None:
    with pytest.raises(FrameError):
        Frames(from_engine).feed(struct.pack("<I", MAX_FRAME_BYTES + 1))


def test_frames_decode_only_into_the_message_types() -> None:
    bogus = msgspec.msgpack.encode(["os.system", "echo hi"])
    with pytest.raises(msgspec.DecodeError):
        Frames(to_engine).feed(struct.pack("<I", len(bogus)) + bogus)
    with pytest.raises(msgspec.ValidationError):  # a Step is no command
        Frames(to_engine).feed(frame(_step(1)))


def test_a_job_crosses_whole() -> None:
    sampling = Sampling(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=3,
        stop=["END", "\n\n"],
        stop_token_ids=[2],
        logprobs=2,
    )
    job = EngineJob("j", [1, 2, 3], 64, sampling, seed=9, resume_ids=[7, 8], text=False)
    [back] = Frames(to_engine).feed(frame(add_message(job, attempt=4)))
    assert isinstance(back, Add) and back.attempt == 4
    assert engine_job(back) == job


def test_the_wire_carries_every_sampling_field() -> None:
    assert SamplingWire.__struct_fields__ == tuple(Sampling.model_fields)


def test_commands_round_trip() -> None:
    commands = [Cancel("j", 2, Stop("expired")), Close()]
    assert Frames(to_engine).feed(b"".join(frame(c) for c in commands)) == commands


def test_the_engine_reads_a_frame_begun_to_its_end_before_it_steps() -> None:
    """The worker writes a turn's commands at once; what the engine process reads without
    waiting is whole frames: the rest of one begun is waited for (it is on its way), not left
    for after the next step."""
    import socket
    import threading

    from worker.wire import Channel

    ours, theirs = socket.socketpair()
    channel = Channel(theirs)
    add = frame(add_message(EngineJob("a", list(range(300)), 8, Sampling(), 1), 1))
    ours.sendall(add[:100])
    rest = threading.Timer(0.05, ours.sendall, args=(add[100:],))
    rest.start()
    try:
        got = channel.receive(wait=False)
        assert got is not None and [type(m) for m in got] == [Add]
        assert engine_job(got[0]).input_ids == list(range(300))
    finally:
        rest.join()
        ours.close()
        theirs.close()
