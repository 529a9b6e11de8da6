"""Which engine a model folder gets (shared/model_format.py), and what the worker says when it
is told to run a folder its engine cannot read."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from genq.cli import _engine_settings, build_parser
from shared.model_format import PLAIN_FOLDER_ENGINE, engine_for_folder, folder_format
from shared.settings import Settings, WorkerSettings
from worker.process import check_engine

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256}


def folder(tmp_path: Path, name: str, config: dict, tensors: list[str] | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        header = json.dumps({"__metadata__": {"format": "pt"}} | {t: {} for t in tensors})
        raw = header.encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return d


def exl3(tmp_path: Path) -> Path:
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6}
    return folder(tmp_path, "m-exl3", LLAMA | {"quantization_config": qc})


def exl2(tmp_path: Path) -> Path:
    qc = {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0}
    return folder(tmp_path, "m-exl2", LLAMA | {"quantization_config": qc})


def test_the_quantization_config_names_the_engine(tmp_path: Path) -> None:
    assert engine_for_folder(exl3(tmp_path)) == "exllamav3"
    assert engine_for_folder(exl2(tmp_path)) == "exllamav2"


def test_a_plain_folder_gets_the_faster_engine(tmp_path: Path) -> None:
    plain = folder(tmp_path, "m", LLAMA, ["model.embed_tokens.weight", "lm_head.weight"])
    assert folder_format(plain) == "plain"
    assert engine_for_folder(plain) == PLAIN_FOLDER_ENGINE


def test_an_exl2_folder_without_quantization_config_is_known_by_its_tensors(tmp_path: Path) -> None:
    old = folder(tmp_path, "old", LLAMA, ["model.layers.0.mlp.up_proj.q_weight", "lm_head.weight"])
    assert engine_for_folder(old) == "exllamav2"
    sharded = folder(tmp_path, "sharded", LLAMA)
    index = {"weight_map": {"model.layers.0.mlp.up_proj.trellis": "model-00001-of-00002"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert engine_for_folder(sharded) == "exllamav3"


def test_other_quantizations_go_to_exllamav2(tmp_path: Path) -> None:
    gptq = folder(tmp_path, "gptq", LLAMA | {"quantization_config": {"quant_method": "gptq"}})
    assert engine_for_folder(gptq) == "exllamav2"


def test_an_unreadable_folder_reads_as_plain(tmp_path: Path) -> None:
    assert folder_format(tmp_path / "missing") == "plain"
    broken = folder(tmp_path, "broken", LLAMA)
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"\xff" * 8)
    assert folder_format(broken) == "plain"


def test_settings_pick_the_engine_from_the_folder_unless_one_is_named(tmp_path: Path) -> None:
    model = exl3(tmp_path)
    assert Settings(model_dir=str(model)).engine == "exllamav3"
    assert Settings(model_dir=str(model), engine="exllamav2").engine == "exllamav2"
    assert Settings().engine == "sim"


def test_the_command_line_leaves_the_choice_to_the_folder(tmp_path: Path) -> None:
    model = exl3(tmp_path)
    args = build_parser().parse_args(["worker", "--model", str(model)])
    given = {k: v for k, v in _engine_settings(args).items() if v is not None}
    assert WorkerSettings(**given).engine == "exllamav3"
    named = build_parser().parse_args(["worker", "--model", str(model), "--engine", "exllamav3"])
    assert _engine_settings(named)["engine"] == "exllamav3"


@pytest.mark.parametrize(("engine", "make"), [("exllamav3", exl2), ("exllamav2", exl3)])
def test_an_engine_told_to_run_a_format_it_cannot_read_says_so(
    tmp_path: Path, engine: str, make: object
) -> None:
    model = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(SystemExit, match=f"which {engine} cannot read"):
        check_engine(Settings(model_dir=str(model), engine=engine))


@pytest.mark.skipif(
    importlib.util.find_spec("exllamav3") is not None, reason="the gpu extra is installed"
)
def test_exllamav3_without_the_gpu_extra_says_install_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"exllamav3 engine needs the gpu extra"):
        check_engine(Settings(model_dir=str(exl3(tmp_path))))


def test_exllamav3_without_a_model_names_the_flag() -> None:
    with pytest.raises(SystemExit, match="--engine exllamav3 needs --model DIR"):
        check_engine(Settings(engine="exllamav3"))
