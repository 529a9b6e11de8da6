"""The model card (shared/schemas.py `ModelCard`) from a model folder's config, tokenizer
config and generation config, as both dynamic-generator engines read them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.schemas import ModelCard

if TYPE_CHECKING:
    from shared.settings import EngineSettings


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _chat_template(tc: dict[str, Any]) -> str | None:
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: take the default one
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return t


def build_card(
    settings: EngineSettings,
    model_dir: Path,
    tokenizer_json: str,
    max_seq_len: int,
    max_batch: int,
    eos_ids: list[int],
    engine: str,
) -> ModelCard:
    tc = _read_json(model_dir / "tokenizer_config.json")
    cfg = _read_json(model_dir / "config.json")
    bos = _token_text(tc.get("bos_token"))
    synthetic = cfg.get("genq_synthetic")
    return ModelCard(
        name=settings.model_name or model_dir.name,
        engine=engine,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        tokenizer_sha=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        bos_token=bos,
        eos_token=_token_text(tc.get("eos_token")),
        eos_token_ids=eos_ids,
        add_bos=bool(tc.get("add_bos_token", bos is not None)),
        chat_template=_chat_template(tc),
        description=synthetic or f"{engine} model from {model_dir.name}",
    )


def eos_ids(model_dir: Path, config_eos: Any) -> list[int]:
    """The model's stop token ids: its config's and generation_config.json's, in order."""
    ids: list[int] = []
    gen = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    for v in (config_eos, gen):
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
