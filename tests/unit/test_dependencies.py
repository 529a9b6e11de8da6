"""What genq declares against what it uses and what the lock files hold: every third-party
module the packages import is declared, a dependency genq reaches into has an upper bound, the
locks hold each dependency within its bounds (and the runtime lock only versions the tests ran
with), and nothing of the GPU stack is locked. Read from pyproject.toml, the locks and the
source, so a bound changed without re-locking (`.ci/lock`) fails here."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import shared

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("genq", "gateway", "worker", "shared")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
LOCK = ROOT / "requirements" / "lock.txt"
LOCK_TEST = ROOT / "requirements" / "lock-test.txt"

INTERNALS = ("fastapi", "uvicorn", "starlette", "redis", "python-multipart")
"""Dependencies whose internals genq subclasses or calls (pyproject.toml says which): each
bounded above, so an upgrade that moves them is tried (`.ci/try-upgrades`), not shipped."""
VIA = {
    "pydantic-core": "pydantic",  # pydantic's own core, pinned exactly by it
    "annotated-types": "pydantic",
    "hiredis": "redis",  # redis[hiredis]
    "uvloop": "uvicorn",  # uvicorn[standard]
    "httptools": "uvicorn",  # uvicorn[standard]
}
"""Imported packages that come with a declared one, by the name of the one they come with."""
GPU_STACK = ("torch", "exllamav2", "exllamav3", "flash-attn", "nvidia-ml-py")


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    listed = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    reqs = [Requirement(r) for r in listed]
    return {canonicalize_name(r.name): r for r in reqs}


def _locked(path: Path) -> dict[str, list[tuple[str, str]]]:
    """name: [(version, marker)], a name pinned once per environment marker."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(?:;\s*([^#]*))?", line)
        if m:
            name = canonicalize_name(m[1])
            out.setdefault(name, []).append((m[2], (m[3] or "").strip()))
    return out


def _imported_distributions() -> dict[str, str]:
    """Distribution name: one module of genq's packages that imports it (stdlib left out)."""
    providers = packages_distributions()
    out: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module.split(".")[0]]
                else:
                    continue
                for name in names:
                    if name in sys.stdlib_module_names or name in PACKAGES:
                        continue
                    for dist in providers.get(name, [name]):
                        out.setdefault(canonicalize_name(dist), str(path.relative_to(ROOT)))
    return out


def test_every_package_genq_imports_is_declared() -> None:
    declared = set(_requirements()) | set(_requirements("gpu"))
    gpu_modules = {"exllamav2", "exllamav3", "torch", "pynvml"}  # not installed here: by name
    undeclared = {
        dist: where
        for dist, where in _imported_distributions().items()
        if dist not in declared and dist not in gpu_modules and VIA.get(dist) not in declared
    }
    assert not undeclared, f"imported, not in pyproject.toml's dependencies: {undeclared}"


@pytest.mark.parametrize("name", INTERNALS)
def test_a_dependency_genq_reaches_into_is_bounded_above(name: str) -> None:
    req = _requirements()[name]
    assert any(s.operator == "<" for s in req.specifier), f"{req}: no upper bound"


@pytest.mark.parametrize(
    ("lock", "extra"), [(LOCK, None), (LOCK_TEST, None), (LOCK_TEST, "test")], ids=str
)
def test_the_locks_hold_each_dependency_within_its_bounds(lock: Path, extra: str | None) -> None:
    locked = _locked(lock)
    for name, req in _requirements(extra).items():
        assert name in locked, f"{lock.name} lacks {name}: run .ci/lock"
        versions = [v for v, _ in locked[name]]
        outside = [v for v in versions if not req.specifier.contains(v, prereleases=True)]
        assert not outside, f"{lock.name}: {name} {outside} outside {req}: run .ci/lock"


def test_the_runtime_lock_holds_only_the_versions_the_tests_ran_with() -> None:
    runtime, tested = _locked(LOCK), _locked(LOCK_TEST)
    for name, pins in runtime.items():
        versions = {v for v, _ in tested.get(name, [])}
        assert {v for v, _ in pins} <= versions, f"{name}: {pins} against {versions or 'none'}"


@pytest.mark.parametrize("lock", [LOCK, LOCK_TEST], ids=lambda p: p.name)
def test_no_gpu_stack_is_locked(lock: Path) -> None:
    locked = _locked(lock)
    assert not [n for n in locked if n in GPU_STACK or n.startswith("nvidia-")]


def test_the_version_has_one_source() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    source = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert source == {"attr": "shared.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", shared.__version__)


def test_each_package_is_typed_and_ships_its_marker() -> None:
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in data.get(package, []), package


def test_the_declared_license_is_in_the_tree() -> None:
    assert PROJECT["license"] == "MIT"
    for name in PROJECT["license-files"]:
        text = (ROOT / name).read_text()
        assert text.startswith("MIT License") and "Copyright (c) 2026 the genq authors" in text


def test_the_docs_name_the_locked_versions() -> None:
    """The "Dependencies" section, wherever the documentation keeps it (README.md, docs/)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = [t for t in (p.read_text() for p in pages) if "\n### Dependencies\n" in t]
    assert len(texts) == 1, "one page has a '### Dependencies' section"
    section = texts[0].split("\n### Dependencies\n", 1)[1]
    named = dict(re.findall(r"([a-z][a-z-]+)\s+(\d+\.\d+\.\d+)", section.split("```")[0]))
    assert set(INTERNALS) <= set(named), named
    locked = _locked(LOCK_TEST)
    for name, version in named.items():
        assert version in [v for v, _ in locked[canonicalize_name(name)]], (name, version)
