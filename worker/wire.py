"""Every message between a worker's I/O process and its engine process, and their framing.

One socket (a socketpair; the engine process inherits its end as a file descriptor) carries
length-prefixed frames: a 4-byte little-endian length, then one msgspec MessagePack value.
Structs are encoded as arrays (field order is the format: both ends run the same code) and
tagged with a small integer; gc=False, since none of them is ever part of a cycle.

    worker → engine   Init (first, once), then Add, Cancel, Close
    engine → worker   Hello (once its model is loaded) or Failed, then a Step per step

Never pickle: a frame decodes only into these types.
"""

from __future__ import annotations

import operator
import socket
import struct
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec

from shared.schemas import SAMPLING_FIELDS, Sampling
from shared.settings import LogFormat, LogLevel
from worker.engine import EngineJob, StepOutput, Stop

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
"""A frame longer than this is a broken stream, not a message."""
_RECV_BYTES = 1 << 18
T = TypeVar("T")


if TYPE_CHECKING:
    SamplingWire = msgspec.Struct
else:
    SamplingWire = msgspec.defstruct(
        "SamplingWire",
        [(name, info.annotation) for name, info in Sampling.model_fields.items()],
        module=__name__,
        array_like=True,
        gc=False,
    )
"""`shared.schemas.Sampling`, field for field, made from its fields (their pydantic limits
are not checked again here: msgspec ignores that metadata, the gateway and the worker have
validated them)."""


class Init(msgspec.Struct, tag=1, array_like=True, gc=False):
    settings: str
    """The EngineSettings fields, as JSON (pydantic reads them once, at start)."""
    gc_in_steps: bool
    """False: no automatic garbage collection while the engine steps (it collects when idle)."""
    log_level: LogLevel
    log_format: LogFormat


class Add(msgspec.Struct, tag=2, array_like=True, gc=False):
    job_id: str
    attempt: int
    input_ids: list[int]
    max_tokens: int
    seed: int
    resume_ids: list[int]
    text: bool
    sampling: SamplingWire
    grammar: str | None = None
    limit: int = 0
    """Join the engine only while it holds fewer jobs (0: its max batch; worker/core.py)."""


class Cancel(msgspec.Struct, tag=3, array_like=True, gc=False):
    job_id: str
    attempt: int
    stop: Stop


class Close(msgspec.Struct, tag=4, array_like=True, gc=False):
    """Stop every job and exit."""


class Hello(msgspec.Struct, tag=10, array_like=True, gc=False):
    card: str
    """The model card, as JSON."""
    tokenizer: str
    max_batch: int
    page_size: int
    total_pages: int
    free_pages: int
    pid: int
    reserved_tokens: int = 0
    prefill_side_by_side: bool = False


class Failed(msgspec.Struct, tag=11, array_like=True, gc=False):
    """The engine could not be built (no model, out of memory): the process exits."""

    error: str


class Step(msgspec.Struct, tag=12, array_like=True, gc=False):
    outputs: list[StepOutput]
    free_pages: int
    free_slots: int
    """Batch slots the engine has free (for information: the worker counts its own)."""
    adds: int
    """Add commands applied since the engine process started."""
    steps: int
    """Engine steps this message carries the outputs of (0: commands only; more than one
    when steps are quicker than the engine process's COALESCE_S)."""
    step_s: float
    """How long those steps took, in the engine's own `step()`."""
    failures: int
    """Consecutive failed steps (0 after one that worked)."""
    waited: bool
    """The engine had no job and waited for commands since its last message."""


ToEngine = Init | Add | Cancel | Close
FromEngine = Hello | Failed | Step

_encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)


def frame(msg: ToEngine | FromEngine) -> bytes:
    buf = bytearray(_HEADER.size)
    _encoder.encode_into(msg, buf, _HEADER.size)
    _HEADER.pack_into(buf, 0, len(buf) - _HEADER.size)
    return bytes(buf)


class FrameError(Exception):
    """The byte stream is not a sequence of frames."""


class Frames(Generic[T]):
    """Bytes in, decoded messages out, across any split of the stream."""

    def __init__(self, decoder: msgspec.msgpack.Decoder[T]) -> None:
        self._decoder = decoder
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[T]:
        buf = self._buf
        buf += data
        out: list[T] = []
        at = 0
        with memoryview(buf) as view:
            while len(buf) - at >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf, at)
                if n > MAX_FRAME_BYTES:
                    raise FrameError(f"frame of {n} bytes announced")
                end = at + _HEADER.size + n
                if end > len(buf):
                    break
                with view[at + _HEADER.size : end] as payload:
                    out.append(self._decoder.decode(payload))
                at = end
        del buf[:at]
        return out

    @property
    def partial(self) -> bool:
        """Part of a frame has arrived, the rest not yet."""
        return bool(self._buf)


# ---- jobs across the boundary --------------------------------------------------------------

_sampling_values = operator.attrgetter(*SAMPLING_FIELDS)
"""A `Sampling`'s values in field order (one C call)."""


def add_message(job: EngineJob, attempt: int, limit: int = 0) -> Add:
    sampling = SamplingWire(*_sampling_values(job.sampling))
    return Add(
        job.id,
        attempt,
        job.input_ids,
        job.max_tokens,
        job.seed,
        job.resume_ids,
        job.text,
        sampling,
        job.grammar,
        limit,
    )


def engine_job(add: Add) -> EngineJob:
    """The job an Add carries. Its sampling was validated by the gateway and again by the
    worker that claimed it: built here without validating a third time."""
    sampling = Sampling.model_construct(**msgspec.structs.asdict(add.sampling))
    return EngineJob(
        add.job_id,
        add.input_ids,
        add.max_tokens,
        sampling,
        add.seed,
        add.resume_ids,
        add.text,
        add.grammar,
    )


# ---- the engine process's end: a blocking socket -------------------------------------------


class Channel:
    """The engine process's end of the socket: blocking sends, reads with or without waiting."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._frames = Frames(to_engine)
        sock.setblocking(True)

    def send(self, msg: FromEngine) -> None:
        self._sock.sendall(frame(msg))

    def receive(self, wait: bool) -> list[ToEngine] | None:
        """The commands that have arrived; with `wait`, block until at least one has. A frame
        begun is read to its end (the worker writes a turn's commands at once: the rest is on
        its way), so commands written together are applied together. None once the
        worker's end is closed."""
        out: list[ToEngine] = []
        while True:
            try:
                flags = 0 if (wait and not out) or self._frames.partial else socket.MSG_DONTWAIT
                data = self._sock.recv(_RECV_BYTES, flags)
            except BlockingIOError:
                return out
            except ConnectionError:
                return None
            if not data:
                return None
            out += self._frames.feed(data)  # nothing yet for part of a frame: read on
