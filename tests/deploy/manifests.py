"""Readers for deploy/: Dockerfile instructions, the compose file, the Kubernetes manifests, and
the genq containers they all describe (command line and GENQ_* environment)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "gpu": DEPLOY / "Dockerfile.gpu"}
GENQ_IMAGES = {"genq", "genq-gpu"}
"""Image names (before the tag) that run genq: the two Dockerfiles' images."""

_COMPOSE_DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array of CMD/ENTRYPOINT/HEALTHCHECK CMD (exec form)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text.split(" CMD ", 1)[1]
        value = json.loads(text)
        assert isinstance(value, list), f"line {self.line}: not exec form: {self.args}"
        return [str(v) for v in value]


def dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined; comments and parser directives dropped."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = n
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        keyword, _, args = " ".join(pending).partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
        pending = []
    return out


def dockerfile_env(instructions: list[Instruction]) -> dict[str, str]:
    """ENV of the final stage (`ENV K=V K2=V2` form)."""
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            env = {}
        elif ins.keyword == "ENV":
            for pair in shlex.split(ins.args):
                key, sep, value = pair.partition("=")
                assert sep, f"line {ins.line}: ENV without '=': {ins.args}"
                env[key] = value
    return env


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def compose_value(value: str) -> str:
    """A compose string with `${VAR:-default}` taken at its default (no such variable set)."""
    return _COMPOSE_DEFAULT.sub(lambda m: m.group(2), value)


def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def k8s_resources() -> list[tuple[str, dict[str, Any]]]:
    """(file name, resource) for every resource the kustomization lists."""
    out = []
    for name in kustomization()["resources"]:
        out.extend((name, doc) for doc in yaml_docs(K8S / name))
    return out


def k8s_find(kind: str, name: str) -> dict[str, Any]:
    hits = [r for _, r in k8s_resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def image_name(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


@dataclass
class Container:
    """A genq process as one deploy file describes it."""

    where: str
    argv: list[str]
    """Arguments after `genq`."""
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    """Port name → container port (compose: the published port's target, named by number)."""

    @property
    def command(self) -> str:
        return self.argv[0]

    def flag(self, name: str) -> str | None:
        if name in self.argv:
            return self.argv[self.argv.index(name) + 1]
        return None


def dockerfile_containers() -> list[Container]:
    out = []
    for kind, path in DOCKERFILES.items():
        stage = final_stage(dockerfile(path))
        (entry,) = [i.exec_form() for i in stage if i.keyword == "ENTRYPOINT"]
        (cmd,) = [i.exec_form() for i in stage if i.keyword == "CMD"]
        assert entry == ["genq"], f"{path.name}: ENTRYPOINT {entry}"
        exposed = [
            int(p.split("/")[0]) for i in stage if i.keyword == "EXPOSE" for p in i.args.split()
        ]
        ports = {str(p): p for p in exposed}
        out.append(Container(f"{path.name} ({kind})", cmd, dockerfile_env(stage), ports))
    return out


def compose_containers() -> list[Container]:
    out = []
    for name, svc in compose()["services"].items():
        if image_name(svc.get("image", "")) not in GENQ_IMAGES:
            continue
        env = {k: compose_value(str(v)) for k, v in svc.get("environment", {}).items()}
        ports: dict[str, int] = {}
        for spec in svc.get("ports", []):
            target = int(str(spec).rsplit(":", 1)[-1])
            ports[str(target)] = target
        argv = [compose_value(a) for a in svc["command"]]
        out.append(Container(f"compose service {name}", argv, env, ports))
    return out


def _configmap_env(kind: str, name: str) -> dict[str, str]:
    doc = k8s_find(kind, name)
    return {k: str(v) for k, v in (doc.get("data") or doc.get("stringData") or {}).items()}


def pod_containers(resource: dict[str, Any]) -> list[dict[str, Any]]:
    return list(resource["spec"]["template"]["spec"]["containers"])


def k8s_containers() -> list[Container]:
    out = []
    for file, res in k8s_resources():
        if res["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in pod_containers(res):
            if image_name(c["image"]) not in GENQ_IMAGES:
                continue
            env: dict[str, str] = {}
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    env.update(_configmap_env("ConfigMap", source["configMapRef"]["name"]))
                if "secretRef" in source:
                    env.update(_configmap_env("Secret", source["secretRef"]["name"]))
            env.update({e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e})
            ports = {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}
            where = f"{file} {res['kind']}/{res['metadata']['name']}/{c['name']}"
            out.append(Container(where, [str(a) for a in c["args"]], env, ports))
    return out


def all_containers() -> list[Container]:
    return dockerfile_containers() + compose_containers() + k8s_containers()


def redis_conf_dir() -> str:
    """The `dir` deploy/redis.conf sets: where Redis writes its AOF."""
    lines = (DEPLOY / "redis.conf").read_text().splitlines()
    dirs = [line.split(None, 1)[1] for line in lines if line.startswith("dir ")]
    assert len(dirs) == 1, "deploy/redis.conf sets one dir"
    return dirs[0].strip()
