"""/dashboard in a real browser (Debian's headless Chromium over the DevTools protocol),
against a real `genq gateway` and sim `genq worker` with API keys on: the page logs in with
the admin key through its form, shows the live worker and its queue, changes as a job runs,
logs no console error, and fits a phone's width. Skipped, saying why, without chromium."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cdp import Page, browser, chromium_path
from tests.conftest import REDIS_URL
from tests.procs import Cluster, quick_cluster

pytestmark = pytest.mark.e2e
ADMIN, USER = "dash-admin-key", "dash-user-key"
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if chromium_path() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    with quick_cluster(
        REDIS_URL,
        tmp_path,
        "dash",
        GENQ_DASHBOARD_INTERVAL_S="0.1",
        GENQ_API_KEYS=USER,
        GENQ_ADMIN_KEYS=ADMIN,
    ) as c:
        yield c


def _log_in(page: Page) -> None:
    page.wait("!document.getElementById('login').hidden")
    page.evaluate(
        f"document.getElementById('key').value = {json.dumps(ADMIN)};"
        "document.getElementById('login').requestSubmit(); true"
    )
    page.wait("document.body.dataset.state === 'live'")


TOKENS_CELL = 4


def _cell(page: Page, row: str, index: int) -> str:
    """The text of cell `index` of the row the CSS selector `row` picks."""
    return str(
        page.evaluate(f"document.querySelector({json.dumps(row)}).cells[{index}].textContent")
    )


def _a_batch(url: str) -> str:
    """A batch of one short line, made with the user's key; its id."""
    headers = {"Authorization": f"Bearer {USER}"}
    body = {"model": "sim", "prompt": "hi", "max_tokens": 2}
    line = {"custom_id": "b0", "method": "POST", "url": "/v1/completions", "body": body}
    f = httpx.post(
        f"{url}/v1/files",
        files={"file": ("b.jsonl", json.dumps(line).encode() + b"\n")},
        data={"purpose": "batch"},
        headers=headers,
        timeout=10,
    )
    assert f.status_code == 200, f.text
    batch = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions"}
    r = httpx.post(f"{url}/v1/batches", json=batch, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _job_status(page: Page, job_id: str) -> str | None:
    value = page.evaluate(
        f"(document.querySelector('[data-job-id=\"{job_id}\"]') || {{dataset: {{}}}})"
        ".dataset.status || null"
    )
    return None if value is None else str(value)


def test_the_dashboard_shows_the_fleet_live_without_errors(
    cluster: Cluster, tmp_path: Path
) -> None:
    gateway = cluster.gateway()
    worker = cluster.worker("--step-ms", "40", wait_model=None)
    with browser(tmp_path / "profile") as page:
        page.open(f"{gateway.url}/dashboard")
        _log_in(page)
        worker_id = page.wait("document.querySelector('[data-worker-id]')?.dataset.workerId")
        assert page.evaluate("document.querySelector('[data-queue=\"sim:interactive\"]') !== null")
        assert page.evaluate("document.querySelector('[data-model=\"sim\"]') !== null")

        r = httpx.post(
            f"{gateway.url}/v1/jobs",
            json={"model": "sim", "prompt": "hello", "max_tokens": 40},
            headers={"Authorization": f"Bearer {USER}"},
            timeout=10,
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        seen: list[str] = []
        busy = False
        so_far: list[str] = []
        page.wait(f"document.querySelector('[data-job-id=\"{job_id}\"]') !== null")
        while (status := _job_status(page, job_id)) != "succeeded":
            assert status is not None
            if not seen or seen[-1] != status:
                seen.append(status)
            busy = busy or page.evaluate(
                f"document.querySelector('[data-worker-id=\"{worker_id}\"]')"
                "?.dataset.active === '1'"
            )
            if status == "running":
                so_far.append(_cell(page, f'[data-job-id="{job_id}"]', TOKENS_CELL))
        assert "running" in seen and busy, seen  # it changed while the job ran, then again
        # while it ran, its tokens so far, marked as growing
        assert any(t.endswith("…") and "→" in t for t in so_far), so_far
        tokens = _cell(page, f'[data-job-id="{job_id}"]', TOKENS_CELL)
        assert tokens.endswith("→ 40")

        # the batches, as wide as the jobs and above them; ids without their common prefix
        batch_id = _a_batch(gateway.url)
        page.wait(f"document.querySelector('[data-batch-id=\"{batch_id}\"]') !== null")
        assert _cell(page, f'[data-batch-id="{batch_id}"]', 0) == batch_id[6:14] + "…"
        assert _cell(page, f'[data-job-id="{job_id}"]', 0) == job_id[:8] + "…"
        assert page.evaluate(
            "!!(document.getElementById('batches').compareDocumentPosition("
            "document.getElementById('jobs')) & Node.DOCUMENT_POSITION_FOLLOWING)"
        )
        widths = page.evaluate(
            "['batches', 'jobs'].map((id) => document.getElementById(id)"
            ".closest('section').offsetWidth)"
        )
        assert widths[0] == widths[1] > 0, widths

        page.call("Emulation.setDeviceMetricsOverride", **PHONE)
        page.wait("window.innerWidth === 390")
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow} px wider than a phone"
        page.pump()
        assert page.errors == []
    assert worker.proc.poll() is None


def test_a_wrong_key_is_refused_on_the_form(cluster: Cluster, tmp_path: Path) -> None:
    gateway = cluster.gateway()
    with browser(tmp_path / "profile") as page:
        page.open(f"{gateway.url}/dashboard")
        page.wait("!document.getElementById('login').hidden")
        page.evaluate(
            f"document.getElementById('key').value = {json.dumps(USER)};"
            "document.getElementById('login').requestSubmit(); true"
        )
        text = page.wait("document.getElementById('login-error').textContent")
        assert text == "not an admin key"
        assert page.evaluate("document.getElementById('main').hidden")
        page.pump()
        assert all("401" in e for e in page.errors), page.errors  # only the refused POST
