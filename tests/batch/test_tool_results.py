"""A batch line under tools: its result line holds the tool calls the live endpoint answers
with (the same ChatFormat reads the job's text back), finish_reason `tool_calls`."""

from __future__ import annotations

import json

from gateway.batch.results import BatchJob, result_of
from shared.constraints import Constraint
from shared.records import JobRecord
from shared.schemas import JobResult, JobSpec, Sampling, Usage


def test_a_tool_call_line_holds_tool_calls() -> None:
    text = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    constraint = Constraint(type="grammar", value="start: x", grammar="{}", origin="tools:hermes")
    spec = JobSpec(
        id="j" * 32,
        model="sim",
        input_ids=[1, 2],
        max_tokens=50,
        sampling=Sampling(),
        priority="batch",
        created_at=1.0,
        constraint=constraint,
    )
    job = BatchJob(line=3, custom_id="c3", chat=True, logprobs=False)
    record = JobRecord(
        spec=spec,
        status="succeeded",
        result=JobResult(text=text, token_ids=[5], finish_reason="stop"),
        usage=Usage(prompt_tokens=2, completion_tokens=20, total_tokens=22),
        metadata=job.metadata("batch_x", None),
        owner="o",
    )
    line = result_of(spec.id, record, None, batch_cancelling=False)
    assert line is not None
    body = json.loads(line.json)["response"]["body"]
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
