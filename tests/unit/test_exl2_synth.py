"""`genq synth-model`: the tiny shape written on CPU is a loadable HF Llama folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from genq.synth import BOS, CHAT_TEMPLATE, SHAPES, synth_model, tensor_shapes

pytest.importorskip("numpy")
safetensors = pytest.importorskip("safetensors")


def test_tiny_model_folder(tmp_path: Path) -> None:
    out = synth_model(tmp_path / "m", "tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == SHAPES["tiny"].tokenizer_vocab
    assert config["bos_token_id"] == tok.token_to_id(BOS)
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert tok.decode(tok.encode(text).ids) == text
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE and tc["bos_token"] == BOS

    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = dict(tensor_shapes(SHAPES["tiny"]))
    assert set(index["weight_map"]) == set(expected)
    from safetensors.numpy import load_file

    tensors: dict = {}
    for fname in set(index["weight_map"].values()):
        tensors.update(load_file(str(out / fname)))
    for name, shape in expected.items():
        t = tensors[name]
        assert t.shape == shape and str(t.dtype) == "float16"
    assert (tensors["model.norm.weight"] == 1).all()
    q = tensors["model.layers.0.self_attn.q_proj.weight"].astype("float32")
    assert abs(float(q.std()) - 0.02) < 0.002 and abs(float(q.mean())) < 0.002
