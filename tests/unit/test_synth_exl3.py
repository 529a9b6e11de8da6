"""`genq synth-model … --quantize exl3`: the shapes EXL3 can quantize, and the conversion run
as a process of its own that resumes after an interruption — against a stand-in converter with
exllamav3's command line (`-i -o -w -b`, `-r` to resume from the work folder)."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from genq import synth
from genq.synth import SHAPES, SYNTHETIC_MARK, quantizable, quantize_exl3
from shared.model_format import folder_format

FAKE_CONVERTER = """
import json, os, sys
args = sys.argv[1:]
opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("-")}
work = opt["-w"]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if "-r" in args:
    job = json.load(open(os.path.join(work, "args.json")))
else:
    os.makedirs(work, exist_ok=True)
    job = {"in_dir": opt["-i"], "out_dir": opt["-o"], "bits": float(opt["-b"])}
    json.dump(job, open(os.path.join(work, "args.json"), "w"))
if os.environ.get("FAKE_MODE") == "interrupt" and "-r" not in args:
    sys.exit(1)
if os.environ.get("FAKE_MODE") == "bad-argument":
    print(" !! Error: --bits must be between 1 and 8")  # exllamav3 says so and exits 0
    sys.exit(0)
config = json.load(open(os.path.join(job["in_dir"], "config.json")))
config["quantization_config"] = {"quant_method": "exl3", "bits": job["bits"]}
os.makedirs(job["out_dir"], exist_ok=True)
json.dump(config, open(os.path.join(job["out_dir"], "config.json"), "w"))
"""


@pytest.fixture
def converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in converter on PYTHONPATH; returns the file its invocations go to."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fakeconvert.py").write_text(textwrap.dedent(FAKE_CONVERTER))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setattr(synth, "EXL3_CONVERTER", "fakeconvert")
    monkeypatch.setattr(synth, "EXL3_MODULES", ())
    return calls


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "m8b"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({SYNTHETIC_MARK: "random", "hidden_size": 256}))
    return src


def calls(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_shape_is_quantizable() -> None:
    assert all(quantizable(s) for s in SHAPES.values())
    odd = SHAPES["tiny"].__class__(**{**SHAPES["tiny"].__dict__, "intermediate": 500})
    assert not quantizable(odd)


def test_conversion_writes_an_exl3_folder_and_cleans_up(
    converter: Path, source: Path, tmp_path: Path
) -> None:
    out = quantize_exl3(tmp_path / "m8b-exl3", 4.0, source, gpus="0,1")
    assert folder_format(out) == "exl3"
    assert json.loads((out / "config.json").read_text())[SYNTHETIC_MARK] == "random"
    [args] = calls(converter)
    assert args[args.index("-i") + 1] == str(source) and args[args.index("-b") + 1] == "4.0"
    assert args[args.index("-d") + 1] == "0,1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls.jsonl", "m8b", "m8b-exl3", "mods"]


def test_an_interrupted_conversion_resumes(
    converter: Path, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "interrupt")
    with pytest.raises(SystemExit, match="run the same command again to resume"):
        quantize_exl3(tmp_path / "q", 4.0, source)
    assert not (tmp_path / "q").exists()
    out = quantize_exl3(tmp_path / "q", 4.0, source)
    first, second = calls(converter)
    assert "-r" not in first and second[-1] == "-r"
    assert folder_format(out) == "exl3"


def test_other_arguments_start_the_conversion_over(
    converter: Path, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "interrupt")
    with pytest.raises(SystemExit):
        quantize_exl3(tmp_path / "q", 4.0, source)
    monkeypatch.delenv("FAKE_MODE")
    quantize_exl3(tmp_path / "q", 3.0, source)
    assert "-r" not in calls(converter)[1]
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == 3.0


def test_a_converter_that_wrote_nothing_is_a_failure(
    converter: Path, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "bad-argument")
    with pytest.raises(SystemExit, match="did not finish"):
        quantize_exl3(tmp_path / "q", 4.0, source)
    assert not (tmp_path / "q").exists()


def test_an_already_quantized_source_is_refused(converter: Path, tmp_path: Path) -> None:
    src = tmp_path / "exl2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl2"}}))
    with pytest.raises(SystemExit, match="already quantized"):
        quantize_exl3(tmp_path / "q", 4.0, src)
    assert not converter.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("exllamav3") is not None, reason="exllamav3 is installed"
)
def test_quantizing_without_exllamav3_says_install_it(source: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"genq\[gpu\]"):
        quantize_exl3(tmp_path / "q", 4.0, source)
    assert not (tmp_path / "q").exists()


def test_calibration_rows_reach_the_converter(
    converter: Path, source: Path, tmp_path: Path
) -> None:
    quantize_exl3(tmp_path / "q", 4.0, source, calibration_rows=8)
    quantize_exl3(tmp_path / "r", 4.0, source)
    with_rows, default = calls(converter)
    assert with_rows[with_rows.index("-cr") + 1] == "8"
    assert "-cr" not in default


def test_calibration_rows_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from genq.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["synth-model", "/tmp/x", "--quantize", "exl3", "--calibration-rows", "0"])
    assert exit_.value.code == 2
    assert "--calibration-rows: must be a whole number of at least 1" in capsys.readouterr().err
