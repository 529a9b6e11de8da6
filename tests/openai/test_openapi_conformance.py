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


def test_every_answer_is_what_the_document_says(server: GenqServer, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    run = subprocess.run(
        [
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
            "--workers",
            "2",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
        check=False,
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]
