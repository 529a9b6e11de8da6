"""deploy/docker-compose.yml: Redis on deploy/redis.conf with its data on a volume, two
gateways, a GPU worker with a device reservation, Prometheus and Grafana in a profile, and a
scrape config whose targets are the services' own ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from genq.cli import DEFAULT_PORT
from tests.deploy import manifests as m

SERVICES = m.compose()["services"]
PROMETHEUS = m.DEPLOY / "prometheus" / "prometheus.yml"


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path → source (a named volume, or a host path relative to deploy/)."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = m.compose_value(spec).split(":")[:2]
        out[target] = source
    return out


def test_default_services_and_profiles() -> None:
    default = {n for n, s in SERVICES.items() if not s.get("profiles")}
    assert default == {"redis", "gateway-1", "gateway-2", "worker"}
    assert SERVICES["prometheus"]["profiles"] == ["metrics"]
    assert SERVICES["grafana"]["profiles"] == ["metrics"]
    assert SERVICES["sim-worker"]["profiles"] == ["sim"]


def test_redis_runs_deploy_redis_conf_with_its_data_on_a_volume() -> None:
    redis = SERVICES["redis"]
    mounts = _mounts(redis)
    command = redis["command"]
    conf = command[1]
    assert command[0] == "redis-server"
    assert (m.DEPLOY / mounts[conf]).resolve() == (m.DEPLOY / "redis.conf").resolve()
    data = m.redis_conf_dir()  # where Redis writes: the file's dir (flags cannot move it)
    assert mounts[data] in m.compose()["volumes"], "Redis data is not on a named volume"
    assert command[command.index("--bind") + 1] == "0.0.0.0", "unreachable by the gateways"
    assert "healthcheck" in redis


def test_volumes_and_bind_mounts_exist() -> None:
    declared = set(m.compose()["volumes"])
    for name, service in SERVICES.items():
        for source in _mounts(service).values():
            if source.startswith((".", "/")):
                assert (m.DEPLOY / source).exists() or source == "./models", (name, source)
            else:
                assert source in declared, f"{name}: volume {source} not declared"


def test_builds_point_at_the_dockerfiles() -> None:
    for name, service in SERVICES.items():
        build = service.get("build")
        if build is None:
            continue
        context = (m.DEPLOY / build["context"]).resolve()
        assert context == m.ROOT, name
        assert (context / build["dockerfile"]).resolve() in m.DOCKERFILES.values(), name


def test_the_gpu_worker_reserves_a_gpu() -> None:
    worker = SERVICES["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert int(device["count"]) >= 1
    assert m.image_name(worker["image"]) == "genq-gpu"
    assert "deploy" not in SERVICES["sim-worker"], "the sim worker needs no GPU"


def test_gateways_and_workers_start_once_redis_is_healthy() -> None:
    for name in ("gateway-1", "gateway-2", "worker", "sim-worker"):
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_each_gateway_is_published_on_a_port_of_its_own() -> None:
    published = [str(SERVICES[g]["ports"][0]).split(":")[0] for g in ("gateway-1", "gateway-2")]
    assert len(set(published)) == 2


def _listen_port(service: dict[str, Any]) -> int:
    command = [m.compose_value(a) for a in service["command"]]
    if command[0] == "gateway":
        return int(command[command.index("--port") + 1]) if "--port" in command else DEFAULT_PORT
    return int(service["environment"]["GENQ_METRICS_PORT"])


def test_prometheus_scrapes_every_genq_service_where_it_listens() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        t
        for job in config["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
        if job.get("metrics_path", "/metrics") == "/metrics"
    }
    genq = {n: s for n, s in SERVICES.items() if m.image_name(s.get("image", "")) in m.GENQ_IMAGES}
    assert targets == {f"{n}:{_listen_port(s)}" for n, s in genq.items()}
    mounted = _mounts(SERVICES["prometheus"])["/etc/prometheus/prometheus.yml"]
    assert (m.DEPLOY / mounted).resolve() == PROMETHEUS.resolve()


def test_grafana_provisions_prometheus() -> None:
    source = Path(_mounts(SERVICES["grafana"])["/etc/grafana/provisioning"])
    (datasource,) = yaml.safe_load(
        (m.DEPLOY / source / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
