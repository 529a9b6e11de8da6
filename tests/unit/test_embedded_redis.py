"""genq/embedded_redis.py: `genq serve`'s private redis-server keeps its data in its folder
for the next one, lets one server at a time use a folder, and with no folder writes nothing
anywhere."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import psutil
import pytest
import redis

from genq.embedded_redis import private_redis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def _server_folder(url: str) -> str:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "redis-server":
            try:
                if any(c.laddr.port == port for c in p.net_connections(kind="tcp")):
                    return p.cwd()
            except psutil.Error:
                continue
    raise AssertionError(f"no redis-server on {port}")


def test_the_data_outlives_the_server_and_one_server_uses_a_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with private_redis(data) as url:
        assert url is not None
        with redis.Redis.from_url(url) as r:
            r.set("kept", "yes")
        with pytest.raises(SystemExit, match=re.escape(f"the data folder {data} is in use")):
            with private_redis(data):
                pass
    with private_redis(data) as url, redis.Redis.from_url(url or "") as r:
        assert r.get("kept") == b"yes"


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "data"
    with pytest.raises(SystemExit, match=re.escape(f"cannot keep data in {where}: ")):
        with private_redis(where):
            pass


def test_a_default_folder_that_cannot_be_made_keeps_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    with private_redis(tmp_path / "file" / "data", chosen=False) as url:
        assert url is not None and not Path(_server_folder(url)).exists()
    assert "keeping none" in caplog.text


def test_without_a_folder_nothing_is_left_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    with private_redis(None) as url:
        assert url is not None
        with redis.Redis.from_url(url) as r:
            r.set("gone", "soon")
            assert r.get("gone") == b"soon"
        assert not Path(_server_folder(url)).exists()  # it runs in a folder already gone
        assert list(tmp_path.iterdir()) == []
