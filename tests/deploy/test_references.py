"""Every genq command, flag, port and GENQ_ variable in the Dockerfiles, the compose file and
the Kubernetes manifests exists in the CLI (genq/cli.py) and the settings (shared/settings.py),
and each container's environment builds its process's settings."""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse

import pytest
from pydantic import ValidationError

from genq.cli import DEFAULT_PORT, build_parser
from shared.settings import GatewaySettings, Settings, WorkerSettings
from tests.deploy import manifests as m

CONTAINERS = m.all_containers()
IDS = [c.where for c in CONTAINERS]
SECTION = {"gateway": GatewaySettings, "worker": WorkerSettings}
_GENQ_VAR = re.compile(r"\bGENQ_[A-Z0-9_]+\b")


def test_the_deploy_files_describe_gateways_and_workers() -> None:
    commands = {(c.where.split()[0], c.command) for c in CONTAINERS}
    for source in ("Dockerfile", "Dockerfile.gpu"):
        assert any(s == source for s, _ in commands), source
    for kind in ("gateway", "worker"):
        assert ("compose", kind) in commands
        assert any(s.endswith(".yaml") and k == kind for s, k in commands), kind


@pytest.mark.parametrize("container", CONTAINERS, ids=IDS)
def test_command_and_flags_exist_in_the_cli(container: m.Container) -> None:
    try:
        args = build_parser().parse_args(container.argv)
    except SystemExit as exc:
        pytest.fail(f"{container.where}: `genq {' '.join(container.argv)}` does not parse ({exc})")
    assert args.command in SECTION, f"{container.where}: runs {args.command}"


@pytest.mark.parametrize("container", CONTAINERS, ids=IDS)
def test_environment_builds_the_settings_of_its_process(
    container: m.Container, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("GENQ_"):
            monkeypatch.delenv(name)
    for name, value in container.env.items():
        monkeypatch.setenv(name, value)
    section = SECTION[container.command]
    try:
        settings = section()
    except ValidationError as exc:
        pytest.fail(f"{container.where}: its environment does not validate: {exc}")
    for name in container.env:
        if name.startswith("GENQ_"):
            field = name.removeprefix("GENQ_").lower()
            where = f"{container.where}: {name}"
            assert field in section.model_fields, f"{where} is no {section.__name__} setting"
            assert field in settings.model_fields_set, f"{where} was not read"


def _deploy_texts() -> dict[str, str]:
    files = [*m.DOCKERFILES.values(), m.COMPOSE, *sorted(m.K8S.glob("*.yaml"))]
    files += sorted((m.DEPLOY / "prometheus").glob("*.yml"))
    files += [m.DEPLOY / "genq.env.example", *sorted(m.DEPLOY.glob("*.service"))]
    return {p.name: p.read_text() for p in files}


def test_every_genq_variable_named_anywhere_is_a_setting() -> None:
    """Comments included: a documented variable that does not exist misleads as much."""
    unknown = {
        (name, var)
        for name, text in _deploy_texts().items()
        for var in _GENQ_VAR.findall(text)
        if var.removeprefix("GENQ_").lower() not in Settings.model_fields
    }
    assert not unknown


@pytest.mark.parametrize("container", [c for c in CONTAINERS if c.command == "gateway"])
def test_gateway_listens_on_every_interface_at_its_declared_port(container: m.Container) -> None:
    assert container.flag("--host") == "0.0.0.0", f"{container.where}: unreachable from outside"
    port = int(container.flag("--port") or DEFAULT_PORT)
    declared = set(container.ports.values())
    assert declared == {port}, f"{container.where}: listens on {port}, declares {declared}"


@pytest.mark.parametrize("container", [c for c in CONTAINERS if c.command == "worker"])
def test_worker_serves_probes_at_its_declared_port(container: m.Container) -> None:
    port = container.env.get("GENQ_METRICS_PORT")
    assert port is not None, f"{container.where}: no GENQ_METRICS_PORT, so no probes"
    if container.ports:  # compose publishes no worker port: Prometheus reaches it in-network
        assert set(container.ports.values()) == {int(port)}, container.where


def test_healthchecks_probe_the_port_the_process_listens_on() -> None:
    for kind, path in m.DOCKERFILES.items():
        stage = m.final_stage(m.dockerfile(path))
        (check,) = [i.exec_form() for i in stage if i.keyword == "HEALTHCHECK"]
        (container,) = [c for c in m.dockerfile_containers() if f"({kind})" in c.where]
        assert check[0] == "genq-healthcheck"
        if container.command == "gateway":
            url = urlparse(check[1])
            assert (
                url.port == int(container.flag("--port") or DEFAULT_PORT) and url.path == "/healthz"
            )
        else:  # no URL: the script probes GENQ_METRICS_PORT, which the image sets
            assert check[1:] == [] and "GENQ_METRICS_PORT" in container.env
