"""shared/logs.py: the formatters, the one dictConfig, the settings and flag behind it."""

from __future__ import annotations

import copy
import io
import json
import logging
import logging.config
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from genq.cli import build_parser
from shared import logs
from shared.settings import RedisSettings


def _record(msg: str = "job claimed", /, **extra: object) -> logging.LogRecord:
    """A record as `logging.getLogger("worker.claims").info(msg, extra=extra)` makes it."""
    return logging.getLogger("worker.claims").makeRecord(
        "worker.claims", logging.INFO, __file__, 1, msg, (), None, extra=extra
    )


def _failed_record() -> logging.LogRecord:
    try:
        raise RuntimeError("engine step failed")
    except RuntimeError:
        return logging.getLogger("worker.runner").makeRecord(
            "worker.runner", logging.ERROR, __file__, 1, "step", (), sys.exc_info()
        )


def test_json_has_the_core_fields_and_the_extras() -> None:
    record = _record(job_id="j1", attempt=2, path=Path("/m"))
    out = json.loads(logs.JsonFormatter().format(record))
    assert out == {
        "ts": round(record.created, 3),
        "level": "info",
        "logger": "worker.claims",
        "process": os.getpid(),
        "msg": "job claimed",
        "job_id": "j1",
        "attempt": 2,
        "path": "/m",  # what JSON cannot hold goes as its str
    }


def test_json_keeps_an_extra_named_like_a_core_field_apart() -> None:
    out = json.loads(logs.JsonFormatter().format(_record(level="high", logger="x")))
    assert out["level"] == "info" and out["extra.level"] == "high"
    assert out["logger"] == "worker.claims" and out["extra.logger"] == "x"


def test_json_carries_the_traceback_on_one_line() -> None:
    line = logs.JsonFormatter().format(_failed_record())
    assert "\n" not in line
    assert "RuntimeError: engine step failed" in json.loads(line)["exc"]


def test_uvicorn_colour_copy_of_the_message_is_dropped() -> None:
    record = _record("Started server process [1]", color_message="\x1b[36mStarted\x1b[0m")
    assert "color_message" not in json.loads(logs.JsonFormatter().format(record))
    assert "color_message" not in logs.TextFormatter().format(record)


def test_text_line_has_local_time_level_process_logger_and_fields() -> None:
    record = _record(job_id="j1", error="Connection refused", attempts=3, gpus=["0", "1"])
    line = logs.TextFormatter().format(record)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
    ms = int(record.msecs)
    assert line == (
        f"{stamp}.{ms:03d} INFO [{os.getpid()}] worker.claims: job claimed "
        'job_id=j1 error="Connection refused" attempts=3 gpus=["0", "1"]'
    )


def test_text_puts_the_traceback_after_the_fields() -> None:
    first, *rest = logs.TextFormatter().format(_failed_record()).split("\n")
    assert first.endswith(f"ERROR [{os.getpid()}] worker.runner: step")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "RuntimeError: engine step failed"


def test_auto_format_is_text_on_a_terminal_json_elsewhere() -> None:
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            assert logs.resolve_format("auto", tty) == "text"
            assert logs.resolve_format("json", tty) == "json"
    finally:
        os.close(leader)
        os.close(follower)
    assert logs.resolve_format("auto", io.StringIO()) == "json"
    assert logs.resolve_format("text", io.StringIO()) == "text"


def test_level_and_format_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENQ_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("GENQ_LOG_FORMAT", "Text")
    s = RedisSettings()
    assert (s.log_level, s.log_format) == ("warning", "text")
    assert logs.log_config(s)["root"]["level"] == "WARNING"
    monkeypatch.setenv("GENQ_LOG_LEVEL", "loud")
    with pytest.raises(ValidationError, match="log_level"):
        RedisSettings()


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """dictConfig replaces the root handlers and uvicorn's loggers: put them back after."""
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "httpx"]
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.mark.usefixtures("restored_logging")
def test_one_config_sends_genq_and_uvicorn_lines_to_one_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logging.getLogger("uvicorn.error").addHandler(logging.NullHandler())  # as uvicorn leaves it
    made_before = logging.getLogger("gateway.pubsub_wire")  # module loggers exist at import
    logs.setup(RedisSettings(log_format="json", log_level="warning"))
    made_before.warning("pub/sub connect failed; retrying", extra={"error": "refused"})
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    logging.getLogger("uvicorn.error").info("Started server process [1]")
    logging.getLogger("httpx").warning("slow")
    out = [json.loads(line) for line in err.getvalue().splitlines()]
    assert [(r["logger"], r["msg"]) for r in out] == [
        ("gateway.pubsub_wire", "pub/sub connect failed; retrying"),
        ("uvicorn.error", "Invalid HTTP request received."),
        ("httpx", "slow"),
    ]
    assert out[0]["error"] == "refused"


@pytest.mark.usefixtures("restored_logging")
def test_httpx_request_lines_stay_quiet_at_info(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.setup(RedisSettings(log_format="json", log_level="info"))
    logging.getLogger("httpx").info('HTTP Request: POST http://x "HTTP/1.1 200 OK"')
    assert err.getvalue() == ""


@pytest.mark.usefixtures("restored_logging")
def test_config_survives_being_applied() -> None:
    """uvicorn applies the dict in its own process, then hands it to each one it spawns."""
    config = logs.log_config(RedisSettings(log_format="text"))
    before = copy.deepcopy(config)
    logging.config.dictConfig(config)
    assert config == before


@pytest.mark.parametrize(
    "argv",
    [["gateway", "--log-level", "debug"], ["--log-level", "debug", "gateway"]],
)
def test_log_level_flag_before_or_after_the_command(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).log_level == "debug"


def test_log_level_flag_defaults_to_the_setting_and_names_its_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert parser.parse_args(["worker"]).log_level is None  # then GENQ_LOG_LEVEL decides
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["gateway", "--log-level", "loud"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--help"])
    assert "--log-level {debug,info,warning,error}" in capsys.readouterr().out
