"""deploy/k8s: every manifest validates against Kubernetes' own schemas (offline, strict), the
CRDs (KEDA, Prometheus operator) against the structure they require, and the pieces fit: labels
and selectors, named ports, probes, grace periods, the GPU, Redis' AOF volume, and a KEDA
trigger per queue that watches the keys genq really writes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from shared.keys import CONSUMER_GROUP, PRIORITIES, Keys
from tests.deploy import manifests as m

KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
"""The oldest release these manifests promise to fit, and the newest the package knows."""
EXIT_MARGIN_S = 10
"""Time a process needs after its grace to leave (hand back, close, free the GPU)."""

RESOURCES = m.k8s_resources()
CRDS = {"keda.sh/v1alpha1", "monitoring.coreos.com/v1"}
BUILT_IN = [(f, r) for f, r in RESOURCES if r["apiVersion"] not in CRDS]
CUSTOM = [(f, r) for f, r in RESOURCES if r["apiVersion"] in CRDS]


def _ids(items: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{f}:{r['kind']}/{r['metadata']['name']}" for f, r in items]


def test_kustomization_lists_every_manifest() -> None:
    listed = set(m.kustomization()["resources"])
    on_disk = {p.name for p in m.K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_kustomization_images_are_the_ones_the_manifests_run() -> None:
    images = {i["name"] for i in m.kustomization()["images"]}
    used = {
        c["image"]
        for _, r in RESOURCES
        if r["kind"] in ("Deployment", "StatefulSet")
        for c in m.pod_containers(r)
        if m.image_name(c["image"]) in m.GENQ_IMAGES
    }
    assert used == images == m.GENQ_IMAGES


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("file", "resource"), BUILT_IN, ids=_ids(BUILT_IN))
def test_validates_against_the_kubernetes_schema(
    file: str, resource: dict[str, Any], version: str
) -> None:
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{file}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_schema_check_rejects_a_typo() -> None:
    deployment = m.k8s_find("Deployment", "genq-worker")
    probe = m.pod_containers(deployment)[0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": list(required),
        "properties": {**required, **optional},
        "additionalProperties": False,
    }


_STR = {"type": "string", "minLength": 1}
_INT = {"type": "integer", "minimum": 0}
_NUMERIC_STR = {"type": "string", "pattern": "^[0-9]+$"}
_METADATA = {"type": "object", "required": ["name"]}
_LABEL_SELECTOR = _object({"matchLabels": {"type": "object", "minProperties": 1}})
_ENDPOINT = _object({"port": _STR, "path": _STR}, interval=_STR)
_REDIS_STREAMS = _object(
    {"address": _STR, "stream": _STR, "consumerGroup": _STR},
    lagCount=_NUMERIC_STR,
    activationLagCount=_NUMERIC_STR,
    pendingEntriesCount=_NUMERIC_STR,
)
_TRIGGER = _object({"type": {"const": "redis-streams"}, "metadata": _REDIS_STREAMS})
SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": _object(
        {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": _METADATA,
            "spec": _object(
                {
                    "scaleTargetRef": _object({"name": _STR}, kind=_STR, apiVersion=_STR),
                    "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
                },
                pollingInterval=_INT,
                cooldownPeriod=_INT,
                minReplicaCount=_INT,
                maxReplicaCount={"type": "integer", "minimum": 1},
                advanced={"type": "object"},
            ),
        }
    ),
    "ServiceMonitor": _object(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _METADATA,
            "spec": _object(
                {
                    "selector": _LABEL_SELECTOR,
                    "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                }
            ),
        }
    ),
    "PodMonitor": _object(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": _METADATA,
            "spec": _object(
                {
                    "selector": _LABEL_SELECTOR,
                    "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                }
            ),
        }
    ),
}


@pytest.mark.parametrize(("file", "resource"), CUSTOM, ids=_ids(CUSTOM))
def test_custom_resources_have_the_structure_their_crd_requires(
    file: str, resource: dict[str, Any]
) -> None:
    schema = SCHEMAS[resource["kind"]]
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(resource)]
    assert not errors, f"{file}: {errors}"


def test_the_crd_check_rejects_a_typo() -> None:
    so = m.k8s_find("ScaledObject", "genq-worker")
    trigger = so["spec"]["triggers"][0]["metadata"]
    trigger["lagcount"] = trigger.pop("lagCount")
    assert list(jsonschema.Draft202012Validator(SCHEMAS["ScaledObject"]).iter_errors(so))


def test_every_custom_resource_kind_has_a_schema() -> None:
    assert {r["kind"] for _, r in CUSTOM} == set(SCHEMAS)


# ---- the pieces fit ---------------------------------------------------------------------


def _workloads() -> list[dict[str, Any]]:
    return [r for _, r in RESOURCES if r["kind"] in ("Deployment", "StatefulSet")]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pods_selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        w for w in _workloads() if _matches(selector, w["spec"]["template"]["metadata"]["labels"])
    ]


def test_workload_selectors_match_their_pods() -> None:
    for w in _workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert _matches(w["spec"]["selector"]["matchLabels"], labels), w["metadata"]["name"]


def _port_names(workload: dict[str, Any]) -> set[str]:
    return {p["name"] for c in m.pod_containers(workload) for p in c.get("ports", [])}


def test_services_select_pods_and_name_their_ports() -> None:
    for _, svc in RESOURCES:
        if svc["kind"] != "Service":
            continue
        (pods,) = _pods_selected(svc["spec"]["selector"])
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in _port_names(pods), svc["metadata"]["name"]


def test_probes_use_declared_ports() -> None:
    for w in _workloads():
        for c in m.pod_containers(w):
            names = {p["name"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                assert port is None or port in names, (w["metadata"]["name"], kind, port)


def test_disruption_budgets_and_autoscaler_target_real_workloads() -> None:
    for _, r in RESOURCES:
        if r["kind"] == "PodDisruptionBudget":
            assert len(_pods_selected(r["spec"]["selector"]["matchLabels"])) == 1
        if r["kind"] == "HorizontalPodAutoscaler":
            m.k8s_find(r["spec"]["scaleTargetRef"]["kind"], r["spec"]["scaleTargetRef"]["name"])
    budgets = {r["metadata"]["name"] for _, r in RESOURCES if r["kind"] == "PodDisruptionBudget"}
    assert {"genq-gateway", "genq-worker"} <= budgets


def test_autoscaled_deployments_leave_replicas_to_the_autoscaler() -> None:
    for name in ("genq-gateway", "genq-worker"):
        assert "replicas" not in m.k8s_find("Deployment", name)["spec"], name


def _container(kind: str, name: str) -> dict[str, Any]:
    (c,) = m.pod_containers(m.k8s_find(kind, name))
    return c


def _grace_s() -> float:
    return float(m.k8s_find("ConfigMap", "genq-config")["data"]["GENQ_SHUTDOWN_GRACE_S"])


def _prestop_s(container: dict[str, Any]) -> float:
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return 0.0
    command = pre["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("name", ["genq-gateway", "genq-worker"])
def test_termination_grace_covers_prestop_drain_and_exit(name: str) -> None:
    pod = m.k8s_find("Deployment", name)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    needed = _prestop_s(container) + _grace_s() + EXIT_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed


def test_worker_drains_on_sigterm_itself() -> None:
    """A preStop sleep would keep the worker claiming jobs it must then hand back."""
    assert _prestop_s(_container("Deployment", "genq-worker")) == 0
    assert _prestop_s(_container("Deployment", "genq-gateway")) > 0


def test_worker_takes_a_gpu_and_is_ready_on_its_readyz() -> None:
    c = _container("Deployment", "genq-worker")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert "GENQ_WORKER_ID" not in env, "a fixed id would let a restart inherit a heartbeat"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == int(env["GENQ_METRICS_PORT"])


def test_redis_keeps_its_aof_on_a_persistent_volume() -> None:
    redis = m.k8s_find("StatefulSet", "genq-redis")
    (c,) = m.pod_containers(redis)
    args = c["args"]
    data_dir = m.redis_conf_dir()  # where Redis writes: the file's dir (flags cannot move it)
    assert args[args.index("--bind") + 1] == "0.0.0.0", "unreachable by the other pods"
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    assert mounts[data_dir] in claims
    conf = m.k8s_find("ConfigMap", "genq-redis-config")["data"]["redis.conf"]
    assert conf == (m.DEPLOY / "redis.conf").read_text(), "differs from deploy/redis.conf"
    assert "appendonly yes" in conf.splitlines()
    conf_dir = args[0].rsplit("/", 1)[0]
    assert mounts[conf_dir] == "config"
    assert m.k8s_find("Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_monitors_scrape_metrics_on_named_ports() -> None:
    sm = m.k8s_find("ServiceMonitor", "genq-gateway")
    (svc,) = [
        r
        for _, r in RESOURCES
        if r["kind"] == "Service"
        and _matches(sm["spec"]["selector"]["matchLabels"], r["metadata"]["labels"])
    ]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    pm = m.k8s_find("PodMonitor", "genq-worker")
    (pods,) = _pods_selected(pm["spec"]["selector"]["matchLabels"])
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= _port_names(pods)
    assert {e["path"] for e in [*sm["spec"]["endpoints"], *pm["spec"]["podMetricsEndpoints"]]} == {
        "/metrics"
    }


# ---- KEDA -------------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    (c,) = [c for c in m.k8s_containers() if c.command == "worker"]
    return c.env


def test_keda_watches_the_queues_genq_writes() -> None:
    so = m.k8s_find("ScaledObject", "genq-worker")
    m.k8s_find("Deployment", so["spec"]["scaleTargetRef"]["name"])
    env = _worker_env()
    keys = Keys(env["GENQ_KEY_PREFIX"])
    model = env["GENQ_MODEL_NAME"]
    triggers = [t["metadata"] for t in so["spec"]["triggers"]]
    streams = [lane for p in PRIORITIES for lane in keys.lanes(model, p)]
    for stream in streams:
        on_queue = [t for t in triggers if t["stream"] == stream]
        assert {t["consumerGroup"] for t in on_queue} == {CONSUMER_GROUP}
        lag = [t for t in on_queue if "lagCount" in t]
        pending = [t for t in on_queue if "pendingEntriesCount" in t]
        assert len(lag) == 1 and "activationLagCount" in lag[0], f"{stream}: no lag trigger"
        assert len(pending) == 1, f"{stream}: no pending trigger: busy workers scaled away"
    assert {t["stream"] for t in triggers} == set(streams)


def test_keda_reaches_redis_by_its_full_service_name() -> None:
    so = m.k8s_find("ScaledObject", "genq-worker")
    namespace = m.kustomization()["namespace"]
    svc = m.k8s_find("Service", "genq-redis")
    expected = f"genq-redis.{namespace}.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    assert {t["metadata"]["address"] for t in so["spec"]["triggers"]} == {expected}


def test_keda_scales_to_zero_and_the_gateway_prepares_the_queue() -> None:
    so = m.k8s_find("ScaledObject", "genq-worker")
    assert so["spec"]["minReplicaCount"] == 0
    (gateway,) = [c for c in m.k8s_containers() if c.command == "gateway"]
    assert _worker_env()["GENQ_MODEL_NAME"] in json.loads(gateway.env["GENQ_QUEUE_MODELS"])
