"""API keys: GENQ_API_KEYS as a comma-separated list (or JSON), GENQ_API_KEYS_FILE, both
`Authorization: Bearer` and `X-API-Key`, 401s with a challenge, never a 5xx from a header, and
one Authorize button in /docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from shared.settings import GatewaySettings, Settings
from tests.conftest import running_stack

JOB = {"model": "sim", "prompt": "x", "max_tokens": 1}


def test_api_keys_take_a_comma_separated_list_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENQ_API_KEYS", "s3cret, other,")
    assert GatewaySettings().api_keys == ["s3cret", "other"]
    monkeypatch.setenv("GENQ_API_KEYS", '["with,comma", "k2"]')
    assert GatewaySettings().api_keys == ["with,comma", "k2"]
    monkeypatch.setenv("GENQ_API_KEYS", "")
    assert GatewaySettings().accepted_api_keys == []


def test_api_keys_file_is_read_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text("# gateway keys\n\n  file-key-1  \n# old: retired\nfile-key-2\n")
    monkeypatch.setenv("GENQ_API_KEYS", "env-key")
    monkeypatch.setenv("GENQ_API_KEYS_FILE", str(path))
    settings = GatewaySettings()
    assert settings.accepted_api_keys == ["env-key", "file-key-1", "file-key-2"]
    assert settings.api_keys == ["env-key"]  # what child processes get as GENQ_API_KEYS


def test_a_keys_file_line_may_set_its_keys_limits_and_weight(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("plain\nb64key== tpm=1000 rpm=60 weight=2.5 # team x\n#c\nopen tpm=0\n")
    settings = GatewaySettings(api_keys_file=path)
    assert settings.accepted_api_keys == ["plain", "b64key==", "open"]
    own = settings.key_options("b64key==")
    assert (own.tpm, own.rpm, own.weight) == (1000, 60.0, 2.5)
    assert settings.key_options("open").tpm == 0 and settings.key_options("plain").tpm is None
    assert settings.per_key_rates and not GatewaySettings(api_keys=["k"]).per_key_rates


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("k tpm=-1", "line 2: tpm='-1': Input should be greater than or equal to 0"),
        ("k weight=0", "line 2: weight='0'"),
        ("k rpm=nan", "line 2: rpm='nan'"),
        ("k burst=3", "line 2: 'burst=3' is no option (after the key: tpm=, rpm=, weight=)"),
        ("k tpm=1 tpm=2", "line 2: tpm= given twice"),
        ("first tpm=5", "line 2: the key of line 1 again, with other options"),
    ],
)
def test_a_bad_keys_file_option_stops_the_start_naming_its_line(
    tmp_path: Path, line: str, error: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"first\n{line}\n")
    with pytest.raises(ValidationError, match=re.escape(f"GENQ_API_KEYS_FILE {error}")) as err:
        GatewaySettings(api_keys_file=path)
    assert "first" not in str(err.value).replace("line 1", "")  # never a key


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n"])
def test_a_missing_or_empty_keys_file_stops_the_start(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValidationError, match="GENQ_API_KEYS_FILE") as err:
        GatewaySettings(api_keys_file=path)
    assert str(path) in str(err.value)


async def test_both_key_headers_are_accepted_and_401s_challenge(
    settings: Settings, redis: aioredis.Redis, tmp_path: Path
) -> None:
    path = tmp_path / "keys"
    path.write_text("from-file\n")
    keyed = Settings(**{**settings.model_dump(), "api_keys": "k1,k2", "api_keys_file": path})
    async with running_stack(keyed, redis) as stack:
        for headers in (
            {"Authorization": "Bearer k2"},
            {"authorization": "bearer from-file"},
            {"X-API-Key": "k1"},
        ):
            r = await stack.client.post("/v1/jobs", json=JOB, headers=headers)
            assert r.status_code == 202, (headers, r.text)
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"}):
            r = await stack.client.post("/v1/jobs", json=JOB, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "raw",
    ["Bearer café".encode(), "Bearer ключ".encode(), b"Bearer \xff\xfe", "Basic ü".encode()],
)
async def test_a_non_ascii_token_is_a_401_not_a_500(
    settings: Settings, redis: aioredis.Redis, raw: bytes
) -> None:
    settings.api_keys = ["k1"]
    async with running_stack(settings, redis) as stack:
        for name in ("Authorization", "X-API-Key"):
            value = raw if name == "Authorization" else raw.removeprefix(b"Bearer ")
            r = await stack.client.post("/v1/jobs", json=JOB, headers={name: value})
            assert r.status_code == 401, (name, r.text)


async def test_docs_offer_one_authorize_button_not_a_header_parameter(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with running_stack(settings, redis) as stack:
        spec = (await stack.client.get("/openapi.json")).json()
    schemes = spec["components"]["securitySchemes"].values()
    assert {"type": "http", "scheme": "bearer"}.items() <= next(
        s for s in schemes if s["type"] == "http"
    ).items()
    assert any(
        s["type"] == "apiKey" and s["in"] == "header" and s["name"] == "X-API-Key" for s in schemes
    )
    operations = [op for path in spec["paths"].values() for op in path.values()]
    submit = spec["paths"]["/v1/jobs"]["post"]
    assert len(submit["security"]) == 2
    for op in operations:
        names = {p["name"].lower() for p in op.get("parameters", [])}
        assert not names & {"authorization", "x-api-key"}, op["operationId"]
