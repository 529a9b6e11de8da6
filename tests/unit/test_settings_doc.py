"""docs/settings.md is what `genq settings --markdown` prints: every setting, its default and
what it does, from the settings classes; a setting added without a description fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from genq import settings_doc
from shared.settings import Settings

DOC = Path(__file__).parents[2] / "docs" / "settings.md"


def test_the_document_is_what_the_command_prints() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "genq", "settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == settings_doc.markdown()
    assert DOC.read_text() == printed, "regenerate: genq settings --markdown > docs/settings.md"


def test_every_setting_is_listed_once_with_a_meaning() -> None:
    entries = list(settings_doc.entries())
    assert sorted(e.variable for e in entries) == sorted(
        f"GENQ_{name.upper()}" for name in Settings.model_fields
    )
    assert [e.variable for e in entries if not e.meaning] == []


def test_defaults_read_as_an_operator_writes_them() -> None:
    by_name = {e.variable: e.default for e in settings_doc.entries()}
    assert by_name["GENQ_KEY_PREFIX"] == "genq:"
    assert by_name["GENQ_ACCESS_LOG"] == "true"
    assert by_name["GENQ_MODEL_DIR"] == "unset"
    assert by_name["GENQ_TORCH_THREADS"] == "1"
