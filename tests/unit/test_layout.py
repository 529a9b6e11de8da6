"""The package layout's import rule: `worker` and `gateway` never import each other, `shared`
imports neither, only `genq` may import both. Read from the source (every import statement,
lazy ones inside functions included), so a violation fails here before it ships."""

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
