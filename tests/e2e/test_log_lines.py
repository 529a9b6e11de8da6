"""The lines an operator reads, from real `genq` processes writing JSON to a file: an access
line per request (fields, the off switch), one line per job step with the right ids, token
counts and timings (at the default level one line per healthy job, its end; the steps before
it at debug), the worker's periodic summary, one warning when Redis is lost and one
"reconnected" line when it is back — and never a prompt or an API key anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.records import owner_of
from tests.conftest import REDIS_URL
from tests.prefixes import test_prefix
from tests.procs import Proc, RedisServer, free_port, wait_for

pytestmark = pytest.mark.e2e

PROMPT = "Periwinkle aardvark 7731 confides its secret"
"""Distinctive enough that finding any of its words in a log means the prompt leaked."""
PROMPT_WORDS = ("Periwinkle", "aardvark", "7731", "confides")
API_KEY = "sk-logtest-0f3c9a77d2e14b5b"
WRONG_KEY = "sk-wrong-9d1e2c3b4a5f6071"
ACCESS = "gateway.access_log"
STOP_TIMEOUT_S = 15.0
OUTAGE_S = 1.5
"""How long Redis stays down in the reconnect test: several failed heartbeats' worth."""


def _genq(tmp_path: Path, *args: str, **env: str) -> Proc:
    """`python -m genq ARGS`, stderr into a file of its own (not a terminal: JSON lines)."""
    log = tmp_path / f"{args[0]}-{uuid.uuid4().hex[:6]}.stderr"
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "genq", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**base, "PYTHONUNBUFFERED": "1", "GENQ_SHUTDOWN_GRACE_S": "2", **env},
        )
    port = int(args[args.index("--port") + 1]) if "--port" in args else None
    return Proc(args[0], proc, log, port)


def _records(*procs: Proc) -> list[dict[str, Any]]:
    """Every complete line of their logs as JSON (a line that is not raises), by time."""
    out = []
    for p in procs:
        lines = p.output().split("\n")[:-1]
        out += [json.loads(line) for line in lines if line.strip()]
    return sorted(out, key=lambda r: r["ts"])


def _with(records: list[dict[str, Any]], msg: str, **fields: object) -> list[dict[str, Any]]:
    return [r for r in records if r["msg"] == msg and all(r.get(k) == v for k, v in fields.items())]


def _access(records: list[dict[str, Any]], **fields: object) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r["logger"] == ACCESS and all(r.get(k) == v for k, v in fields.items())
    ]


def _stop(*procs: Proc) -> None:
    for p in procs:
        p.stop(STOP_TIMEOUT_S)


def _ready(url: str, headers: dict[str, str]) -> None:
    wait_for(lambda: httpx.get(f"{url}/readyz", timeout=1).status_code == 200, what="gateway")
    wait_for(
        lambda: httpx.get(f"{url}/v1/models", headers=headers, timeout=1).json()["data"],
        what="the sim model's card",
    )


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    """`genq gateway` (API keys on) and `genq worker --engine sim`, separate processes."""
    env = {"GENQ_REDIS_URL": REDIS_URL, "GENQ_KEY_PREFIX": test_prefix("logs")}
    env["GENQ_LOG_LEVEL"] = "debug"  # no line at any level may carry the prompt or a key
    gateway = _genq(tmp_path, "gateway", "--port", str(free_port()), GENQ_API_KEYS=API_KEY, **env)
    worker = _genq(tmp_path, "worker", "--engine", "sim", "--step-ms", "5", **env)
    try:
        _ready(gateway.url, {"Authorization": f"Bearer {API_KEY}"})
        yield gateway, worker
    finally:
        _stop(worker, gateway)


def _submit_and_follow(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job queued (202) and followed to its end with GETs, and a job streamed (SSE) to its
    end; each as its final GET shows it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 7}
    queued = httpx.post(f"{url}/v1/jobs", json=body, headers=headers).json()

    def ended() -> bool:
        job = httpx.get(f"{url}/v1/jobs/{queued['id']}", headers=headers).json()
        return bool(job["status"] == "succeeded")

    wait_for(ended, what="the queued job's end")
    stream = {**body, "stream": True, "max_tokens": 40}
    with httpx.stream("POST", f"{url}/v1/jobs", json=stream, headers=headers) as r:
        assert r.status_code == 200
        streamed_id = r.headers["x-job-id"]
        assert "event: done" in r.read().decode()
    job_a = httpx.get(f"{url}/v1/jobs/{queued['id']}", headers=headers).json()
    job_b = httpx.get(f"{url}/v1/jobs/{streamed_id}", headers=headers).json()
    return job_a, job_b


def test_a_job_is_logged_at_each_step_and_every_request_once(fleet: tuple[Proc, Proc]) -> None:
    gateway, worker = fleet
    job_a, job_b = _submit_and_follow(gateway.url)
    refused = httpx.post(
        f"{gateway.url}/v1/jobs", json={"model": "sim"}, headers={"X-API-Key": WRONG_KEY}
    )
    assert refused.status_code == 401
    wait_for(
        lambda: _with(_records(worker), "job finished", job_id=job_b["id"]),
        what=f"the streamed job's finished line: {worker.output()[-800:]}",
    )
    wait_for(lambda: _access(_records(gateway), status=401), what="the 401's access line")
    records = _records(gateway, worker)
    owner = owner_of(API_KEY.encode())
    [worker_started] = _with(records, "worker started")
    worker_id = worker_started["worker_id"]

    # the job's steps, in order, with the ids, counts and timings its record holds
    for job in (job_a, job_b):
        [queued] = _with(records, "job queued", job_id=job["id"])
        [started] = _with(records, "job started", job_id=job["id"])
        [finished] = _with(records, "job finished", job_id=job["id"])
        # the gateway logs `queued` once its SUBMIT returns: a worker may start the job first
        assert started["ts"] <= finished["ts"] and queued["ts"] <= finished["ts"]
        assert queued["logger"] == "gateway.job_service" and queued["process"] == gateway.proc.pid
        assert queued["level"] == started["level"] == "debug"  # the info line is the end
        assert (queued["model"], queued["priority"], queued["owner"]) == (
            "sim",
            "interactive",
            owner,
        )
        assert queued["prompt_tokens"] == job["usage"]["prompt_tokens"]
        assert queued["max_tokens"] == job["usage"]["completion_tokens"]  # sim runs to length
        assert (started["attempt"], started["worker_id"]) == (1, worker_id)
        assert started["process"] == worker.proc.pid
        assert finished["level"] == "info" and finished["status"] == "succeeded"
        assert finished["worker_id"] == worker_id and finished["model"] == "sim"
        assert finished["finish_reason"] == job["finish_reason"] == "length"
        assert finished["prompt_tokens"] == job["usage"]["prompt_tokens"]
        assert finished["generation_tokens"] == job["usage"]["completion_tokens"]
        timings = job["timings"]
        assert finished["queue_s"] == timings["queue_s"]
        assert finished["ttft_s"] == timings["ttft_s"]
        assert finished["decode_s"] == timings["generation_s"]
        rate = job["usage"]["completion_tokens"] / timings["generation_s"]
        assert finished["tokens_per_s"] == pytest.approx(rate, abs=0.1)

    # access lines: one per request, the route's template, the job, the owner hash
    [posted] = _access(records, method="POST", status=202)
    assert posted["route"] == "/v1/jobs" and posted["job_id"] == job_a["id"]
    assert posted["owner"] == owner and posted["client"].startswith("127.0.0.1:")
    assert posted["msg"] == "POST /v1/jobs 202" and posted["level"] == "info"
    assert 0 < posted["duration_ms"] < 10_000 and posted["bytes"] > 0
    gets = _access(records, method="GET", route="/v1/jobs/{job_id}")
    assert {g["job_id"] for g in gets} == {job_a["id"], job_b["id"]}
    assert all(g["status"] == 200 and g["owner"] == owner for g in gets)
    [streamed] = _access(records, method="POST", status=200)
    assert streamed["job_id"] == job_b["id"] and streamed["route"] == "/v1/jobs"
    [finished_b] = _with(records, "job finished", job_id=job_b["id"])
    # logged at the stream's end: it lasted at least the job's decoding
    assert streamed["duration_ms"] >= finished_b["decode_s"] * 1000
    [unauthorized] = _access(records, status=401)
    assert unauthorized["route"] == "/v1/jobs" and "owner" not in unauthorized
    assert "job_id" not in unauthorized
    readyz = _access(records, route="/readyz")
    assert readyz and all("owner" not in r for r in readyz)  # no key: no owner
    assert not [r for r in records if r["logger"] == "uvicorn.access"]  # no double lines

    # neither the prompt nor a key, anywhere
    text = gateway.output() + worker.output()
    for secret in (*PROMPT_WORDS, API_KEY, WRONG_KEY):
        assert secret not in text


def test_the_access_log_switches_off_and_the_worker_sums_up(tmp_path: Path) -> None:
    port = free_port()
    serve = _genq(
        tmp_path,
        "serve",
        "--port",
        str(port),
        "--step-ms",
        "2",
        GENQ_REDIS_URL=REDIS_URL,
        GENQ_KEY_PREFIX=test_prefix("logs"),
        GENQ_ACCESS_LOG="false",
        GENQ_LOG_SUMMARY_INTERVAL_S="0.3",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _ready(url, {})
        jobs = [
            httpx.post(
                f"{url}/v1/jobs", json={"model": "sim", "prompt": PROMPT, "max_tokens": n}
            ).json()
            for n in (3, 5, 8)
        ]

        def summaries() -> list[dict[str, Any]]:
            return _with(_records(serve), "worker summary")

        wait_for(lambda: sum(s["finished"] for s in summaries()) == len(jobs), what="summed up")
        first_after = len(summaries())
        wait_for(lambda: len(summaries()) > first_after, what="one more (idle) summary")
    finally:
        _stop(serve)
    records = _records(serve)
    assert len(_with(records, "job finished")) == len(jobs)  # the job lines stay on
    for job in jobs:  # at the default level, a healthy job is one line: its end
        [line] = [r for r in records if job["id"] in (r.get("job_id"), *r.get("job_ids", ()))]
        assert (line["msg"], line["level"], line["logger"]) == (
            "job finished",
            "info",
            "worker.joblog",
        )
    assert not _access(records) and not [r for r in records if r["logger"] == "uvicorn.access"]
    lines = _with(records, "worker summary")
    assert sum(s["tokens"] for s in lines) == 3 + 5 + 8
    assert sum(s["started"] for s in lines) == sum(s["succeeded"] for s in lines) == len(jobs)
    assert all(s["failed"] == s["cancelled"] == s["requeued"] == 0 for s in lines)
    busy = [s for s in lines if s["tokens"]]
    for s in busy:  # both rounded: the rate to 0.1, the interval to 1 ms (0.5 ms off at most,
        # which moves tokens / interval by up to tokens * 0.0005 / interval^2)
        slack = 0.05 + s["tokens"] * 0.0005 / (s["interval_s"] - 0.0005) ** 2 + 1e-6
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["interval_s"], abs=slack)
    idle = lines[-1]
    assert (idle["running"], idle["claimed"], idle["finished"], idle["tokens"]) == (0, 0, 0, 0)
    # the sim engine counts no cache pages; its batch slots are the limit
    assert idle["slots_total"] == 256 and idle["kv_pages_total"] == 0 and idle["kv_use"] is None
    assert all(0.2 < s["interval_s"] < 2.0 for s in lines[1:])
    assert not any(word in serve.output() for word in PROMPT_WORDS)


REDIS_LOST = "lost connection to Redis"
PER_CALL_LINES = {
    "heartbeat failed",
    "claim failed; retrying",
    "reclaim failed",
    "gateway heartbeat failed",
    "deadline sweep failed",
    "control channel failed; resubscribing",
}
"""Lines the loops log about a failed call of their own: not at warning during an outage."""


def test_a_redis_outage_is_one_warning_and_one_reconnected_line(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.dir.mkdir()
    server.start()
    env = {"GENQ_REDIS_URL": server.url, "GENQ_HEARTBEAT_S": "0.2"}
    gateway = _genq(tmp_path, "gateway", "--port", str(free_port()), **env)
    worker = _genq(tmp_path, "worker", "--engine", "sim", "--step-ms", "1", **env)
    procs = (gateway, worker)

    def each_logged(msg: str) -> bool:
        return all(any(r["msg"].startswith(msg) for r in _records(p)) for p in procs)

    try:
        _ready(gateway.url, {})
        server.kill()
        wait_for(lambda: each_logged(REDIS_LOST), what=f"'{REDIS_LOST}' from both")
        lost_at = time.monotonic()
        while time.monotonic() - lost_at < OUTAGE_S:  # the outage itself: nothing to await
            time.sleep(0.1)
        server.start()
        wait_for(lambda: each_logged("reconnected to Redis after"), what="both reconnected")
        job = httpx.post(
            f"{gateway.url}/v1/jobs", json={"model": "sim", "prompt": "x", "max_tokens": 2}
        ).json()
        wait_for(
            lambda: httpx.get(f"{gateway.url}/v1/jobs/{job['id']}").json()["status"] == "succeeded",
            what="a job after the outage",
        )
    finally:
        _stop(worker, gateway)
        server.kill()
    for p in procs:
        records = _records(p)
        [lost] = _with(records, REDIS_LOST)
        [back] = [r for r in records if r["msg"].startswith("reconnected to Redis after")]
        assert (lost["level"], back["level"]) == ("warning", "info")
        assert lost["logger"] == back["logger"] == "shared.redis_health"
        assert lost["error"]  # what the call that made it an outage met (refused, closed)
        assert back["down_s"] >= OUTAGE_S and back["failures"] >= 2
        said = float(back["msg"].removeprefix("reconnected to Redis after ").removesuffix(" s"))
        assert said == pytest.approx(back["down_s"], abs=0.051)
        during = [r for r in records if lost["ts"] <= r["ts"] <= back["ts"]]
        assert not [r for r in during if r["msg"] in PER_CALL_LINES], during
