"""The manual builds: `mkdocs build --strict` (mkdocs.yml) turns a broken link or anchor
between its pages into an error, and README.md, the front page, links only to files that
exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
pytest.importorskip("material", reason="mkdocs-material is not installed (the docs extra)")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the tree at root, run there (the README snippets that
    docs/index.md takes are found from the working directory)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_the_manual_builds_in_strict_mode(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    front = (tmp_path / "site" / "index.html").read_text()
    assert "Try it" in front, "docs/index.md lost the README's opening"
    assert "genq worker" in front, "docs/index.md lost the README's picture of the processes"
    for page in ("api", "openai", "limits", "batch", "reliability", "configuration"):
        assert (tmp_path / "site" / page / "index.html").exists(), page


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strictness is the configuration's (validation: anchors), not a default: a copy of
    the manual with one link to an anchor that no page has must not build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(README, tmp_path / "README.md")
    api = tmp_path / "docs" / "api.md"
    api.write_text(api.read_text() + "\nSee [nowhere](limits.md#no-such-heading).\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-heading" in done.stdout + done.stderr


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if "://" not in t]
    targets = [t.split("#")[0] for t in targets if not t.startswith(("#", "mailto:"))]
    assert targets, "the README links to the docs pages"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
