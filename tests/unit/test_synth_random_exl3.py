"""`genq synth-model --quantize exl3 --random-trellis`: an EXL3 model written directly, in the
storage exllamav3's loader reads (`LinearEXL3`: `trellis` int16 of input/16 x output/16 x
16*bits, `suh`/`svh` fp16, the `mul1` codebook marker an int32 scalar it checks per file),
read back here with safetensors. That it loads and generates on exllamav3 is the GPU test
`test_a_random_trellis_model_loads_and_generates`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from genq import synth
from genq.cli import main
from shared.model_format import engine_for_folder, folder_format

np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

SMALL_CORPUS = 20_000


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(synth.CORPUS_BYTES, "tiny", SMALL_CORPUS)


def tensors(folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_numpy.load_file(str(shard)))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synth.CORPUS_BYTES, "tiny", SMALL_CORPUS)
        folder = synth.synth_model(tmp_path_factory.mktemp("m") / "tiny-rt", "tiny", exl3_bits=4)
    return folder, tensors(folder)


def test_every_projection_is_stored_as_exllamav3_stores_exl3(
    written: tuple[Path, dict[str, Any]],
) -> None:
    _, t = written
    s = synth.SHAPES["tiny"]
    projections = 0
    for name, (out, inp) in ((n, shape) for n, shape in synth.tensor_shapes(s) if len(shape) == 2):
        if name == "model.embed_tokens.weight":
            assert t[name].dtype == np.float16 and t[name].shape == (s.vocab, s.hidden)
            continue
        key = name.removesuffix(".weight")
        bits = synth.EXL3_HEAD_BITS if key == "lm_head" else 4
        assert name not in t, f"{name} kept as fp16"
        trellis = t[f"{key}.trellis"]
        assert trellis.dtype == np.int16 and trellis.shape == (inp // 16, out // 16, 16 * bits)
        for part, n in (("suh", inp), ("svh", out)):
            v = t[f"{key}.{part}"]
            assert v.dtype == np.float16 and v.shape == (n,)
            assert (np.abs(v) == np.float16(synth.EXL3_SIGN_SCALE)).all()
            assert (v > 0).any() and (v < 0).any()
        marker = t[f"{key}.mul1"]
        assert marker.dtype == np.int32 and marker.shape == ()
        assert int(marker.view(np.uint32)) == 0x83DCD12D
        projections += 1
    assert projections == s.layers * 7 + 1
    for i in range(s.layers):
        norm = t[f"model.layers.{i}.input_layernorm.weight"]
        assert norm.dtype == np.float16 and (norm == 1).all()


def test_the_trellis_holds_random_bits_not_a_pattern(written: tuple[Path, dict[str, Any]]) -> None:
    _, t = written
    bits = t["model.layers.0.mlp.down_proj.trellis"].ravel()
    assert len(np.unique(bits)) > 0.5 * min(len(bits), 65_536)
    assert abs(float(bits.astype(np.float64).mean())) < 0.02 * 32_768
    other = t["model.layers.1.mlp.down_proj.trellis"].ravel()
    assert (bits != other).mean() > 0.99


def test_the_folder_reads_as_exl3_and_picks_exllamav3(written: tuple[Path, dict[str, Any]]) -> None:
    folder, _ = written
    assert folder_format(folder) == "exl3"
    assert engine_for_folder(folder) == "exllamav3"


def test_the_cli_writes_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-rt"
    assert (
        main(["synth-model", str(out), "--quantize", "exl3", "--random-trellis", "--bits", "3"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    t = tensors(out)
    assert t["model.layers.0.self_attn.q_proj.trellis"].shape[-1] == 48


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--random-trellis"], "--random-trellis goes with --quantize exl3"),
        (["--quantize", "exl3", "--random-trellis", "--bits", "4.2"], "--bits 4.2"),
        (["--quantize", "exl3", "--random-trellis", "--source", "x"], "--source is for a conv"),
        (
            ["--quantize", "exl3", "--random-trellis", "--calibration-rows", "8"],
            "--calibration-rows",
        ),
    ],
)
def test_what_does_not_go_with_it_is_refused(tmp_path: Path, argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit, match=says.replace(".", r"\.")):
        main(["synth-model", str(tmp_path / "bad"), *argv])
    assert not (tmp_path / "bad").exists()
