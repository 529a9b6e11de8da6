"""The native job API through the gateway app and an in-process sim worker."""

from __future__ import annotations

from tests.conftest import Stack, parse_sse


async def test_job_runs_to_completion_and_reports_result(stack: Stack) -> None:
    job = await stack.submit(prompt="the model", max_tokens=12, seed=7)
    assert job["status"] == "queued"
    done = await stack.wait_status(job["id"], "succeeded")
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 12
    assert done["usage"]["prompt_tokens"] == 2
    assert done["text"]


async def test_streamed_text_equals_result(stack: Stack) -> None:
    r = await stack.client.post(
        "/v1/jobs", json={"model": "sim", "prompt": "hello", "max_tokens": 30, "stream": True}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert events[0][1] == "queued" and events[1][1] == "started" and events[-1][1] == "done"
    text = "".join(e[2]["text"] for e in events if e[1] == "token")
    count = sum(e[2]["count"] for e in events if e[1] == "token")
    assert count == 30
    job = await stack.wait_status(r.headers["x-job-id"], "succeeded")
    assert job["text"] == text
