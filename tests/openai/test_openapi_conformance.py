"""The API document is true: schemathesis (its command line, as a user runs it) generates
requests from /openapi.json, valid and invalid ones, against a real gateway, and every answer
must be what the document says: a documented status and content type, a body of the documented
schema, no 5xx, schema-invalid input refused, schema-valid input not refused as invalid, and
405 with a true `Allow` for methods a path does not take.

Bounded: a fixed number of examples per operation (no `--max-time`: with one, fuzzing repeats
until the time is spent), a per-request timeout, a timeout for the whole run, and a fixed seed,
so the run is the same every time and takes well under a minute."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.openai.conftest import API_KEY, GenqServer

EXAMPLES_PER_OPERATION = 10
REQUEST_TIMEOUT_S = 10
SEED = 13
RUN_TIMEOUT_S = 90
SHARES = [
    ("--include-path-regex", "^/v1/completions$"),
    ("--include-path-regex", "^/v1/chat/completions$"),
    ("--exclude-path-regex", "^/v1/(chat/)?completions$", "--exclude-name", "POST /v1/files"),
]
"""The operations, split in three schemathesis processes run at once (less the upload: its
body is a JSON-lines file each line of which must pass the live endpoint's checks, which no
schema says; tests/batch covers it): the two largest schemas
alone, then everything else (one process's `--workers` share Hypothesis, which is not
thread-safe: an internal error now and then)."""


def test_every_answer_is_what_the_document_says(server: GenqServer, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    command = [
        st,
        "run",
        f"{server.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--phases",
        "examples,coverage,fuzzing",  # stateful: nothing links one job's id to the next
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--no-color",
    ]
    runs = [
        subprocess.Popen(
            [*command, *share],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for share in SHARES
    ]
    try:
        for run in runs:
            out, _ = run.communicate(timeout=RUN_TIMEOUT_S)
            assert run.returncode == 0, out[-20000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
