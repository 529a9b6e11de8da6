"""Logging for every genq process: one `logging.config.dictConfig` (`log_config`), applied by
`setup` in the process the command line starts and handed to uvicorn as its `log_config`, which
uvicorn applies again in each worker process it spawns. uvicorn's own loggers go to the same
handler.

Lines are human-readable (local time) when stderr is a terminal, else one JSON object each;
`GENQ_LOG_FORMAT=text|json` forces one. Both carry the record's `extra` fields: callers pass ids
(job_id, worker_id) there; prompts and API keys are never logged.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
from typing import Any, TextIO

import msgspec

from shared.settings import LogFormat, RedisSettings

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_IGNORED = {"color_message"}
"""uvicorn's copy of its message with ANSI colours: noise beside `msg`."""
_QUIET = {"httpx": "WARNING"}
"""httpx logs every request at info (genq submit, genq bench, the bench tools)."""
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")
_FORMATTERS = {"json": "shared.logs.JsonFormatter", "text": "shared.logs.TextFormatter"}


_SKIP = frozenset(_STANDARD | _IGNORED)


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller passed in `extra`."""
    return {k: v for k, v in record.__dict__.items() if k not in _SKIP}


def _as_text(value: object) -> str:
    """What JSON cannot hold (a Path, an exception) goes as its str."""
    return str(value)


_ENCODER = msgspec.json.Encoder(enc_hook=_as_text)
"""msgspec, not json.dumps: a third of the cost of a line at the rates of the access log
(measured: docs/performance.md, "Logs")."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch seconds), level, logger, process, msg, the extra
    fields (one named like a core field gets an `extra.` prefix), exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.process,
            "msg": record.getMessage(),
        }
        for k, v in extras(record).items():
            out[f"extra.{k}" if k in out else k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        try:
            return _ENCODER.encode(out).decode()
        except (TypeError, ValueError, OverflowError):  # e.g. a dict keyed by tuples
            return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """`2025-06-01 14:03:07.123 WARNING [4242] gateway.pubsub_wire: message key=value …`"""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s.%(msecs)03d %(levelname)s [%(process)d] %(name)s: %(message)s",
            datefmt="%Y-%m-%d %H:%M:%S",
        )

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = "".join(f" {k}={_text_value(v)}" for k, v in extras(record).items())
        return super().formatMessage(record) + fields


def _text_value(v: object) -> str:
    """Bare when it reads unambiguously, else JSON-quoted (spaces, quotes, `=`, lists …)."""
    if isinstance(v, int | float | bool) or (
        isinstance(v, str) and v and not any(c.isspace() or c in "\"'=" for c in v)
    ):
        return str(v)
    return json.dumps(v, default=str)


def resolve_format(fmt: LogFormat, stream: TextIO | None = None) -> str:
    """`auto`: text on a terminal, JSON otherwise (files, pipes, journald)."""
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    return "text" if stream.isatty() else "json"


def log_config(settings: RedisSettings) -> dict[str, Any]:
    """The dictConfig of every genq process; `auto` is decided here, in the calling process,
    so the processes uvicorn spawns from this dict write what their parent does."""
    level = settings.log_level.upper()
    loggers: dict[str, Any] = {name: {"level": lvl} for name, lvl in _QUIET.items()}
    # uvicorn's loggers carry handlers of their own when uvicorn configured them; none here,
    # so their records reach the root handler like everyone's.
    loggers.update({name: {"handlers": [], "propagate": True} for name in _UVICORN})
    return {
        "version": 1,
        "disable_existing_loggers": False,  # module loggers made at import time keep working
        "formatters": {"genq": {"()": _FORMATTERS[resolve_format(settings.log_format)]}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "genq",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": loggers,
    }


def setup(settings: RedisSettings) -> None:
    # No line shows its caller's file, line or thread: skip looking them up for every record
    # (the logging HOWTO's "Optimization"; ~2 µs of a ~10 µs line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.config.dictConfig(log_config(settings))
