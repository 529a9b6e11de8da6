"""The Redis key contract and the wire schemas."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared import events
from shared.events import EventError, TokenEvent
from shared.keys import Keys, event_id, seq_of
from shared.schemas import JobCreate
from shared.settings import Settings


def test_keys_of_one_job_share_a_cluster_hash_tag() -> None:
    k = Keys("app:")
    tags = {
        key[key.index("{") : key.index("}") + 1]
        for key in (k.job("ab"), k.events("ab"), k.channel("ab"))
    }
    assert tags == {"{ab}"}
    assert all(key.startswith("app:") for key in (k.queue("m", "batch"), k.worker("w"), k.models()))


def test_queues_are_per_model_and_priority() -> None:
    k = Keys()
    assert len({k.queue("a", "interactive"), k.queue("a", "batch"), k.queue("b", "batch")}) == 3


def test_event_ids_round_trip() -> None:
    assert event_id(7) == "0-7"
    assert seq_of("0-7") == 7 and seq_of(b"0-12") == 12


def test_unsafe_prefix_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(key_prefix="a{b}")


def test_stream_events_parse_by_type() -> None:
    ev = events.decode('{"seq": 3, "type": "token", "text": "x", "token_ids": [1], "count": 1}')
    assert isinstance(ev, TokenEvent) and ev.count == 1
    with pytest.raises(EventError):
        events.decode('{"seq": 3, "type": "nope"}')


def test_job_needs_exactly_one_input() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        JobCreate(model="m")
    with pytest.raises(ValidationError, match="exactly one"):
        JobCreate(model="m", prompt="x", input_ids=[1])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("priority", "urgent"),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("seed", -1),
        ("unknown_field", 1),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {"-1": 1.0}),
        ("logit_bias", {"05": 1.0}),  # one key per token
        ("logit_bias", {"5": 100.5}),
        ("logit_bias", {"5": True}),
        ("logit_bias", {str(i): 1.0 for i in range(1025)}),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("banned_strings", [""]),
        ("banned_strings", ["x"] * 17),
        ("banned_strings", ["x" * 513]),
    ],
)
def test_bad_fields_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        JobCreate.model_validate({"model": "m", "prompt": "x", field: value})
    assert field in str(err.value)


def test_logit_bias_takes_openais_shape() -> None:
    job = JobCreate.model_validate(
        {"model": "m", "prompt": "x", "logit_bias": {"50256": -100, "0": 2.5}}
    )
    assert job.logit_bias == {"50256": -100.0, "0": 2.5}
