"""/docs and /redoc render with no network beyond the gateway: headless Chromium, every host
but 127.0.0.1 unresolvable, loads each page, runs its scripts, and the operations are on it.
Their assets come from the package (gateway/docs_assets), not from a CDN."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.cdp import chromium_path, headless_args
from tests.openai.conftest import GenqServer

BROWSER_TIMEOUT_S = 60
SCRIPT_TIME_MS = 15_000
"""Virtual time the page's scripts get before the DOM is read (Chromium skips idle waits)."""
SMALLEST_BUNDLE_BYTES = 100_000
"""Each vendored bundle is far larger: a smaller answer is no bundle (an error page, a stub)."""


def _chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    return path


def rendered_dom(url: str, profile: Path) -> str:
    """The page's DOM once its scripts ran, in headless Chromium with no network."""
    run = subprocess.run(
        [
            *headless_args(_chromium(), profile),
            f"--virtual-time-budget={SCRIPT_TIME_MS}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _paths(server: GenqServer) -> set[str]:
    return set(httpx.get(f"{server.url}/openapi.json").json()["paths"])


def test_swagger_ui_renders_every_operation_offline(server: GenqServer, tmp_path: Path) -> None:
    dom = rendered_dom(f"{server.url}/docs", tmp_path)
    shown = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', dom))
    assert shown == _paths(server), dom[-2000:]
    assert "Authorize" in dom  # the bearer / X-API-Key security schemes


def test_redoc_renders_every_operation_offline(server: GenqServer, tmp_path: Path) -> None:
    dom = rendered_dom(f"{server.url}/redoc", tmp_path)
    for path in _paths(server):
        assert path in dom, f"{path} missing from /redoc"


def test_the_docs_assets_and_their_licenses_ship_in_the_package(server: GenqServer) -> None:
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        r = httpx.get(f"{server.url}/docs/assets/{name}")
        assert r.status_code == 200 and len(r.content) > SMALLEST_BUNDLE_BYTES
    assets = Path(__file__).resolve().parents[2] / "gateway" / "docs_assets"
    assert {"LICENSE-swagger-ui", "NOTICE-swagger-ui", "LICENSE-redoc"} <= {
        p.name for p in assets.iterdir()
    }
