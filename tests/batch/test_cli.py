"""`genq batch` against the real `genq serve`: submit --wait writes the results and the
errors beside them; Ctrl-C while waiting leaves the batch running; status, list, cancel."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.batch.conftest import (
    POISON,
    Serve,
    chat_line,
    completion_line,
    jsonl,
    run_batch,
    wait_ended,
)

CLI_S = 60.0
INTERRUPTED = 130
BROKEN_PIPE = 141


def _genq(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "genq", "batch", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=CLI_S,
    )


def test_submit_wait_writes_results_and_errors(genq: Serve, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    lines = [completion_line(f"r{i}", f"p {i}") for i in range(20)]
    lines.append(completion_line("bad", f"{POISON} p"))
    source.write_bytes(jsonl(lines))
    out = tmp_path / "results.jsonl"
    done = _genq("submit", str(source), "--wait", "-o", str(out), url=genq.url)
    assert done.returncode == 0, done.stderr
    assert "21/21 done (1 failed)" in done.stderr and "completed" in done.stderr
    # the bar: done/total [elapsed<ETA, rate]
    assert re.search(r"21/21 \[\d+:\d\d<\d+:\d\d, +[\d.]+ ?(req/s|s/req)", done.stderr), done.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in results) == sorted(f"r{i}" for i in range(20))
    errors = [json.loads(x) for x in (tmp_path / "results.errors.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in errors] == ["bad"]
    batch_id = done.stderr.split()[1].rstrip(":")  # "batch <id>: 21 requests"
    status = _genq("status", batch_id, url=genq.url)
    assert status.returncode == 0 and "completed" in status.stdout and "21/21" in status.stdout
    assert batch_id in _genq("list", url=genq.url).stdout
    fetched = _genq("results", batch_id, "--errors", url=genq.url)
    assert json.loads(fetched.stdout)["custom_id"] == "bad"


def test_ctrl_c_while_waiting_leaves_the_batch_running(
    genq: Serve, tmp_path: Path, client: openai.OpenAI
) -> None:
    source = tmp_path / "long.jsonl"
    source.write_bytes(jsonl([chat_line(f"l{i}", f"x {i}", max_tokens=64) for i in range(300)]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "genq", "batch", "submit", str(source), "--wait", "--url", genq.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
        # as a terminal's foreground process has it: a test run in a background job inherits
        # SIGINT ignored, and Python then raises no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # "batch <id>: 300 requests": created, now waiting
    batch_id = first.split()[1].rstrip(":")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=CLI_S)
    assert proc.returncode == INTERRUPTED, err
    assert f"genq batch status {batch_id}" in err and "keeps running" in err
    assert client.batches.retrieve(batch_id).status in ("validating", "in_progress")
    cancelled = _genq("cancel", batch_id, url=genq.url)
    assert cancelled.returncode == 0 and batch_id in cancelled.stdout
    assert wait_ended(client, batch_id).status == "cancelled"


def test_a_refused_batch_leaves_no_uploaded_file(
    genq: Serve, tmp_path: Path, client: openai.OpenAI
) -> None:
    source = tmp_path / "refused-window.jsonl"
    source.write_bytes(jsonl([completion_line("r0", "p")]))
    done = _genq("submit", str(source), "--window", "48h", url=genq.url)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("genq: error: ") and "completion_window" in line
    assert source.name not in [f.filename for f in client.files.list()]


def test_output_cut_short_by_its_reader_ends_quietly(genq: Serve, client: openai.OpenAI) -> None:
    """`genq batch list | head -1`: the reader leaves before genq writes; no traceback."""
    run_batch(client, [completion_line("h0", "p")], endpoint="/v1/completions")
    with subprocess.Popen(
        [sys.executable, "-m", "genq", "batch", "list", "--url", genq.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first line
        err = proc.stderr.read()
        assert proc.wait(CLI_S) == BROKEN_PIPE and err == ""


def test_malformed_ids_are_not_found_for_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
