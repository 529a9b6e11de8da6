"""The package layout's import rule: `worker` and `gateway` never import each other, `shared`
imports neither, only `genq` may import both; an engine package (worker/exl2, worker/exl3)
imports its own library and `worker.dyngen`, never the other engine. Read from the source
(every import statement, lazy ones inside functions included), so a violation fails here
before it ships."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("genq", "gateway", "worker", "shared")
FORBIDDEN = {
    "shared": {"gateway", "worker", "genq"},
    "gateway": {"worker", "genq"},
    "worker": {"gateway", "genq"},
    "genq": set(),
}


def _imports(path: Path) -> set[str]:
    """Top-level package of every module `path` imports (absolute imports only)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_packages_import_only_what_the_layout_allows() -> None:
    broken = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = _imports(path) & FORBIDDEN[package]
            if bad:
                broken.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not broken, "import rule broken:\n" + "\n".join(broken)


ENGINE_PACKAGES = {"worker.exl2": "exllamav2", "worker.exl3": "exllamav3"}
"""Each dynamic-generator engine's package and its library: it may import its library and
`worker.dyngen` (what the two share), never the other engine's package or library."""


def _module_imports(path: Path) -> set[str]:
    """Every module `path` imports, dotted (absolute imports only; `from a import b` counts
    as `a` and `a.b`, so a package import of a submodule is seen)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _engine_violations(package: str, imports: set[str]) -> set[str]:
    """What of `imports` a module of engine `package` may not import."""
    others = {p for p in ENGINE_PACKAGES if p != package}
    libraries = {lib for p, lib in ENGINE_PACKAGES.items() if p != package}
    return {
        m
        for m in imports
        if any(m == o or m.startswith(f"{o}.") for o in others) or m.split(".")[0] in libraries
    }


def test_an_engine_package_never_imports_the_other_engine() -> None:
    broken = []
    for package in ENGINE_PACKAGES:
        folder = ROOT / package.replace(".", "/")
        for path in sorted(folder.rglob("*.py")):
            bad = _engine_violations(package, _module_imports(path))
            if bad:
                broken.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not broken, "engine import rule broken:\n" + "\n".join(broken)


def test_the_shared_engine_base_imports_no_engine() -> None:
    """`worker.dyngen` is what both engines build on: it imports neither engine nor library."""
    engines = {*ENGINE_PACKAGES, *ENGINE_PACKAGES.values()}
    broken = []
    for path in sorted((ROOT / "worker" / "dyngen").rglob("*.py")):
        bad = {m for m in _module_imports(path) if any(m.startswith(e) for e in engines)}
        if bad:
            broken.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not broken, "\n".join(broken)


def test_the_engine_rule_check_sees_a_violation(tmp_path: Path) -> None:
    """A lazy import of the other engine, in either form, counts; the base and its own
    library do not."""
    f = tmp_path / "m.py"
    f.write_text(
        "from worker.dyngen.results import step_output\n"
        "from worker import exl2\n"
        "def f():\n    from worker.exl2.loader import Backend\n    import exllamav2\n"
        "    import exllamav3\n"
    )
    bad = _engine_violations("worker.exl3", _module_imports(f))
    assert bad == {"worker.exl2", "worker.exl2.loader", "worker.exl2.loader.Backend", "exllamav2"}


def test_the_rule_check_sees_a_violation(tmp_path: Path) -> None:
    """The checker itself: a lazy import inside a function counts."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from worker.service import Worker\n    import gateway.app\n")
    assert _imports(f) == {"worker", "gateway"}


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_a_gateway_process_loads_no_worker_code() -> None:
    """What `genq gateway` imports to serve: no worker package, no fakeredis, no trainer."""
    loaded = _modules_after(
        "import genq.cli, gateway.server, gateway.app\n"
        "from shared.settings import GatewaySettings\n"
        "gateway.app.create_app(GatewaySettings())"
    )
    assert not {m for m in loaded if m == "worker" or m.startswith("worker.")}
    assert "fakeredis" not in loaded
    assert "tokenizers.trainers" not in loaded
