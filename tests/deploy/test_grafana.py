"""deploy/grafana: the dashboard is provisioned from where docker-compose mounts it, and every
metric (and every label it groups by) in its PromQL is one genq exports: read from a real
gateway app's and a real worker's /metrics after a job ran."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.settings import Settings
from tests.conftest import running_stack
from tests.deploy import manifests as m
from tests.deploy.test_compose import SERVICES, _mounts
from tests.integration.test_metrics import stream_then_leave

DASHBOARD = m.DEPLOY / "grafana" / "dashboards" / "genq.json"
PROVIDER = m.DEPLOY / "grafana" / "provisioning" / "dashboards" / "genq.yml"
METRIC = re.compile(r"\bgenq_[a-z0-9_]+")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_total")
FLEET_WITHIN_S = 10.0


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def test_grafana_provisions_the_dashboard_from_where_compose_mounts_it() -> None:
    mounts = _mounts(SERVICES["grafana"])
    (provider,) = yaml.safe_load(PROVIDER.read_text())["providers"]
    folder = provider["options"]["path"]
    assert (m.DEPLOY / mounts[folder]).resolve() == DASHBOARD.parent.resolve()
    assert (m.DEPLOY / mounts["/etc/grafana/provisioning"] / "dashboards" / PROVIDER.name).exists()
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "genq" and dashboard["panels"]


def _exported(texts: list[str]) -> dict[str, set[str]]:
    """Every series name exported (a histogram's `_bucket` too) → its label names."""
    out: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


async def _scrapes(settings: Settings, redis: Any) -> list[str]:
    settings.metrics_fleet_interval_s = 0.05
    settings.metrics_fleet_lease_s = 1.0
    async with running_stack(settings, redis) as stack:
        job = await stack.submit(prompt="for the dashboard", max_tokens=5)
        await stack.wait_status(job["id"], "succeeded")
        left = asyncio.Event()
        left.set()  # a client that leaves at once: a disconnect
        body = {"model": "sim", "prompt": "gone", "stream": True}
        await stream_then_leave(stack.client._transport.app, body, left)  # type: ignore[attr-defined]
        async with asyncio.timeout(FLEET_WITHIN_S):
            while True:
                gateway = (await stack.client.get("/metrics")).text
                worker = (await stack.worker.st.metrics.respond()).body.decode()
                if "genq_queue_length{" in gateway and "genq_request_success_total{" in worker:
                    return [gateway, worker]
                await asyncio.sleep(0.02)


async def test_every_metric_and_label_in_the_dashboard_is_exported(
    settings: Settings, redis
) -> None:  # type: ignore[no-untyped-def]
    exported = _exported(await _scrapes(settings, redis))
    # Grafana's own label_values() names a family, not a series
    families = exported | {
        n.removesuffix(s): ls for n, ls in exported.items() for s in SERIES_SUFFIXES
    }
    used = set()
    for expr in _exprs():
        names = METRIC.findall(expr)
        assert names, f"no genq metric in {expr!r}"
        for name in names:
            assert name in families, f"{name} (in {expr!r}) is not exported"
            used.add(name)
        labels = set().union(*(families[n] for n in names))
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in labels, f"{expr!r} groups by {label!r}, which {names} lack"
    # and the dashboard shows the names the issue asks for
    for name in ("genq_time_to_first_token_seconds_bucket", "genq_queue_lag", "genq_dead_letters"):
        assert name in used
