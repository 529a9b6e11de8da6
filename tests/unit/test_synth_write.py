"""`genq synth-model` leaves no half-written folder: it writes beside the destination under a
hidden name and renames at the end. The weights writer is replaced here (numpy and
safetensors are the gpu extra's), so this runs on a CPU install; the tokenizer is real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from genq import synth

SMALL_CORPUS = 20_000
"""Bytes of tokenizer training text: enough for the tiny vocabulary's special tokens."""


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(synth.CORPUS_BYTES, "tiny", SMALL_CORPUS)
    monkeypatch.setattr(synth, "_writer_modules", lambda: ())


def _weights_then(fail: bool) -> Any:
    def write(shape: synth.Shape, out: Path, seed: int, exl3_bits: float | None = None) -> None:
        (out / "model-00001-of-00001.safetensors").write_bytes(b"half a shard")
        if fail:
            raise OSError(28, "No space left on device")

    return write


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synth, "_write_weights", _weights_then(fail=True))
    with pytest.raises(OSError, match="No space left"):
        synth.synth_model(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(shape: synth.Shape, out: Path, seed: int, exl3_bits: object = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "_write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synth.synth_model(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_the_folder_appears_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synth, "_write_weights", _weights_then(fail=False))
    out = synth.synth_model(tmp_path / "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "tokenizer.json"}


def test_an_earlier_synth_folder_is_replaced_other_folders_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synth, "_write_weights", _weights_then(fail=False))
    out = synth.synth_model(tmp_path / "tiny")
    (out / "stale").write_text("from the earlier run")
    synth.synth_model(out)
    assert not (out / "stale").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match="not a genq synth-model folder"):
        synth.synth_model(mine)
    assert [p.name for p in mine.iterdir()] == ["config.json"]
