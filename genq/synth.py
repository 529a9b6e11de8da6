"""`genq synth-model DIR --shape tiny|1b|8b`: a random-weight Llama checkpoint for testing;
`--quantize exl3 --bits 4` converts one to EXL3 (exllamav3's converter, on the GPU), and
`--quantize exl3 --random-trellis` writes an EXL3 one directly (any machine, seconds).

No checkpoint can be downloaded on the GPU machines, and speed depends only on the shapes,
so a random-weight model with a real model's shapes measures what that model would. The
folder is a plain HF Llama checkpoint: fp16 safetensors (norm weights 1, the rest
N(0, 0.02)), `config.json`, and a byte-level BPE `tokenizer.json` trained with `tokenizers`
on the Python standard library's own sources (always on disk, no download).

Weights are drawn with torch on the GPU when it is there (seconds for 8B), else with numpy.
The folder is written beside its destination under a hidden name and renamed into place at
the end, so an interrupted or failed run leaves no half-written model behind. A conversion
keeps its work folder beside the destination until it finishes, so one that was interrupted
(a time limit, a lost machine) resumes where it stopped when run again with the same
arguments.

A converted 8B model costs about ten minutes of GPU time, and what it computes is as
meaningless as its fp16 source. `--random-trellis` writes the EXL3 storage itself instead:
each projection (and the lm_head) as exllamav3 stores it -- `trellis` (int16, input/16 x
output/16 x 16*bits, random bits), `suh` and `svh` (fp16 sign vectors, scaled so the weights
have about the fp16 synth model's spread) and the `mul1` codebook marker -- beside fp16
embeddings and norms. exllamav3's kernels run the same work on random bits as on trained
ones, so speed is what a real EXL3 model of that shape and bit rate would give.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shared.model_format import folder_format
from worker.engines import require_gpu_extra

INIT_STD = 0.02
"""Standard deviation of every non-norm weight (the usual Llama initialisation)."""
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS_BYTES = {"tiny": 2_000_000, "1b": 8_000_000, "8b": 8_000_000}
"""How much stdlib source trains the tokenizer: enough for the vocabulary, fast to train."""
SHARD_BYTES = 4 * 1024**3
"""Largest safetensors shard written (HF convention: several files plus an index)."""
SYNTHETIC_MARK = "genq_synthetic"
"""Key of config.json that marks a folder as this command's: one it may replace."""
QUANT_MULTIPLE = 128
"""EXL3 quantizes weights in 128-wide blocks: every projection's dimensions (hidden,
intermediate, vocabulary, attention heads x head size) must be multiples of it."""
EXL3_CONVERTER = "exllamav3.conversion.convert_model"
EXL3_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
"""Bit rates an EXL3 trellis can hold (the half-integer ones with the mul1 codebook)."""
EXL3_HEAD_BITS = 6
"""The lm_head's bit rate (exllamav3's converter default)."""
EXL3_MUL1_MARKER = 0x83DCD12D - 2**32
"""The value of a tensor's `.mul1` marker: the mul1 codebook's multiplier 0x83DCD12D, which
exllamav3 checks once per file, as the int32 scalar it is stored as (safetensors has no
uint32)."""
EXL3_SIGN_SCALE = INIT_STD**0.5
"""|suh| = |svh|: a weight is about suh * (a unit-spread codebook value) * svh."""
EXL3_MODULES = ("torch", "exllamav3")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    """Rows of the embedding and lm_head; may exceed the tokenizer's (exllamav2 masks the rest)."""
    tokenizer_vocab: int
    max_positions: int
    rope_theta: float


SHAPES: dict[str, Shape] = {
    "tiny": Shape(256, 512, 2, 4, 2, 4096, 4096, 4096, 10_000.0),
    # Llama 3.2 1B and Llama 3 8B shapes.
    "1b": Shape(2048, 8192, 16, 32, 8, 128_256, 32_000, 8192, 500_000.0),
    "8b": Shape(4096, 14_336, 32, 32, 8, 128_256, 32_000, 8192, 500_000.0),
}


def tensor_shapes(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint, in file order, with its HF name."""
    head_dim = s.hidden // s.heads
    yield "model.embed_tokens.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (s.hidden,)
        yield p + "self_attn.q_proj.weight", (s.heads * head_dim, s.hidden)
        yield p + "self_attn.k_proj.weight", (s.kv_heads * head_dim, s.hidden)
        yield p + "self_attn.v_proj.weight", (s.kv_heads * head_dim, s.hidden)
        yield p + "self_attn.o_proj.weight", (s.hidden, s.heads * head_dim)
        yield p + "post_attention_layernorm.weight", (s.hidden,)
        yield p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)
        yield p + "mlp.up_proj.weight", (s.intermediate, s.hidden)
        yield p + "mlp.down_proj.weight", (s.hidden, s.intermediate)
    yield "model.norm.weight", (s.hidden,)
    yield "lm_head.weight", (s.vocab, s.hidden)


def _corpus(limit: int) -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= limit:
            return


def train_tokenizer(vocab: int, corpus_bytes: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS, EOT, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(corpus_bytes), trainer=trainer)
    return tok


def _config(s: Shape, bos_id: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.hidden // s.heads,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_positions,
        "rope_theta": s.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        SYNTHETIC_MARK: "random weights from `genq synth-model`; not a language model",
    }


def _tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for t in [BOS, EOS, EOT, *CHAT_TOKENS]
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


class _Sampler:
    """Draws fp16 tensors: torch on CUDA when available (fast), numpy otherwise."""

    def __init__(self, seed: int) -> None:
        self.torch: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                self.torch = torch
                self.gen = torch.Generator(device="cuda").manual_seed(seed)
        except ImportError:
            pass
        if self.torch is None:
            import numpy as np

            self.np = np
            self.rng = np.random.default_rng(seed)

    def draw(self, name: str, shape: tuple[int, ...]) -> Any:
        """The tensor `name` by its kind: a norm (ones), an EXL3 part (see the module's
        doc), or a weight (N(0, INIT_STD))."""
        kind = name.rsplit(".", 1)[-1]
        if self.torch is not None:
            t = self.torch
            if name.endswith("norm.weight"):
                return t.ones(shape, dtype=t.float16)
            if kind == "mul1":
                return t.tensor(EXL3_MUL1_MARKER, dtype=t.int32)
            if kind == "trellis":
                bits = t.randint(-(2**15), 2**15, shape, generator=self.gen, device="cuda")
                return bits.to(t.int16).cpu()
            if kind in ("suh", "svh"):
                coin = t.randint(0, 2, shape, generator=self.gen, device="cuda")
                return ((coin * 2 - 1) * EXL3_SIGN_SCALE).to(t.float16).cpu()
            x = t.randn(shape, generator=self.gen, device="cuda", dtype=t.float16) * INIT_STD
            return x.cpu()
        np = self.np
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=np.float16)
        if kind == "mul1":
            return np.array(EXL3_MUL1_MARKER, dtype=np.int32)
        if kind == "trellis":
            return self.rng.integers(-(2**15), 2**15, shape, dtype=np.int16)
        if kind in ("suh", "svh"):
            signs = self.rng.integers(0, 2, shape, dtype=np.int8) * 2 - 1
            return (signs * EXL3_SIGN_SCALE).astype(np.float16)
        return (self.rng.standard_normal(shape, dtype=np.float32) * INIT_STD).astype(np.float16)

    def save(self, tensors: dict[str, Any], path: Path) -> None:
        if self.torch is not None:
            from safetensors.torch import save_file
        else:
            from safetensors.numpy import save_file  # type: ignore[assignment]
        save_file(tensors, str(path), metadata={"format": "pt"})


def _writer_modules() -> tuple[str, ...]:
    """What `_Sampler` will import: safetensors, and numpy unless torch has a GPU to draw on."""
    try:
        import torch

        if torch.cuda.is_available():
            return ("safetensors",)
    except ImportError:
        pass
    return ("numpy", "safetensors")


def exl3_tensor_shapes(
    s: Shape, bits: float, head_bits: float = EXL3_HEAD_BITS
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """`tensor_shapes` as exllamav3 stores an EXL3 model of `bits` bits per weight: each
    projection and the lm_head as trellis, sign vectors and codebook marker, the rest as is."""
    for name, shape in tensor_shapes(s):
        if len(shape) != 2 or name == "model.embed_tokens.weight":
            yield name, shape
            continue
        key = name.removesuffix(".weight")
        out, inp = shape  # HF stores (out, in); exllamav3 works on (in, out)
        k = head_bits if key == "lm_head" else bits
        yield f"{key}.suh", (inp,)
        yield f"{key}.svh", (out,)
        yield f"{key}.trellis", (inp // 16, out // 16, int(16 * k))
        yield f"{key}.mul1", ()


def _write_weights(s: Shape, out: Path, seed: int, exl3_bits: float | None = None) -> None:
    sampler = _Sampler(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    tensors = tensor_shapes(s) if exl3_bits is None else exl3_tensor_shapes(s, exl3_bits)
    for name, shape in tensors:
        n = 2
        for d in shape:
            n *= d
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        sampler.save({name: sampler.draw(name, shape) for name, shape in shard}, out / fname)
        weight_map.update({name: fname for name, _ in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _special_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:  # the trainer was given it as a special token: always there
        raise RuntimeError(f"tokenizer lacks {token}")
    return int(token_id)


def synth_model(
    out_dir: str | Path, shape: str = "tiny", seed: int = 0, exl3_bits: float | None = None
) -> Path:
    """Write a random-weight Llama checkpoint of `shape` into `out_dir` (new, empty, or an
    earlier synth-model folder, which is replaced); returns the folder. `exl3_bits`: write it
    as EXL3 of that many bits per weight, random trellis (see the module's doc)."""
    require_gpu_extra("genq synth-model", _writer_modules())
    if exl3_bits is not None:
        if exl3_bits not in EXL3_BITS:
            raise SystemExit(
                f"genq: error: --bits {exl3_bits:g}: an EXL3 trellis holds "
                + ", ".join(f"{b:g}" for b in EXL3_BITS)
            )
        _check_quantizable(shape)
    out = Path(out_dir)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        _write_model(shape, partial, seed, exl3_bits)
        _move_into_place(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _check_replaceable(out: Path) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or SYNTHETIC_MARK not in config:
        raise SystemExit(
            f"genq: error: {out} exists and is not a genq synth-model folder: "
            "remove it or pick another"
        )


def _move_into_place(partial: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _write_model(shape: str, out: Path, seed: int, exl3_bits: float | None = None) -> None:
    s = SHAPES[shape]
    tok = train_tokenizer(s.tokenizer_vocab, CORPUS_BYTES[shape])
    tok.save(str(out / "tokenizer.json"))
    bos_id = _special_id(tok, BOS)
    eos_ids = [_special_id(tok, EOS), _special_id(tok, EOT)]
    config = _config(s, bos_id, eos_ids)
    if exl3_bits is not None:
        config["quantization_config"] = {
            "quant_method": "exl3",
            "bits": exl3_bits,
            "head_bits": EXL3_HEAD_BITS,
            "codebook": "mul1",
            "genq_random_trellis": True,
        }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_ids}, indent=1)
    )
    _write_weights(s, out, seed, exl3_bits)


# ---- EXL3 -----------------------------------------------------------------------------------


def quantizable(s: Shape) -> bool:
    """Whether EXL3 can quantize every projection of shape `s`."""
    head_dim = s.hidden // s.heads
    dims = (s.hidden, s.intermediate, s.vocab, s.heads * head_dim, s.kv_heads * head_dim)
    return all(d % QUANT_MULTIPLE == 0 for d in dims)


def _check_quantizable(shape: str) -> None:
    if not quantizable(SHAPES[shape]):
        raise SystemExit(f"genq: error: shape {shape} has a dimension EXL3 cannot quantize")


def quantize_exl3(
    out_dir: str | Path,
    bits: float,
    source: str | Path | None = None,
    shape: str = "tiny",
    seed: int = 0,
    gpus: str | None = None,
    calibration_rows: int | None = None,
) -> Path:
    """Write an EXL3 model of `bits` bits per weight into `out_dir`: exllamav3's converter
    (calibration data from its wheel) run on `source`, an fp16 model folder, or on a new synth
    model of `shape`, on `gpus` (e.g. "0,1": the converter splits each layer's tensors among
    them; default GPU 0). `calibration_rows`: rows of 2,048 calibration tokens (exllamav3's
    default 250); fewer convert faster, and a random-weight model has nothing to calibrate.
    Returns the folder."""
    require_gpu_extra("genq synth-model --quantize exl3", EXL3_MODULES)
    out = Path(out_dir)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.exl3-work")
    src = Path(source) if source else work / "fp16"
    if source:
        _check_source(src)
    elif not src.exists():  # synth_model writes it whole or not at all
        _check_quantizable(shape)
        synth_model(src, shape, seed)
    partial = out.with_name(f".{out.name}.exl3-partial")
    _convert(src, partial, work / "job", bits, gpus, calibration_rows)
    _move_into_place(partial, out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def _check_source(src: Path) -> None:
    if not (src / "config.json").is_file():
        raise SystemExit(f"genq: error: {src} has no config.json: not a model folder (--source)")
    fmt = folder_format(src)
    if fmt != "plain":
        raise SystemExit(f"genq: error: {src} is already quantized ({fmt}): give an fp16 one")


def _convert(
    src: Path, partial: Path, job: Path, bits: float, gpus: str | None, rows: int | None = None
) -> None:
    """Run the converter in a process of its own (its progress on stderr), resuming the job
    in `job` if it was started with the same arguments, else starting over."""
    cmd = [sys.executable, "-m", EXL3_CONVERTER, "-w", str(job)]
    if gpus:
        cmd += ["-d", gpus]
    if _resumable(job, src, partial, bits):
        cmd.append("-r")
    else:
        shutil.rmtree(job, ignore_errors=True)
        shutil.rmtree(partial, ignore_errors=True)
        cmd += ["-i", str(src), "-o", str(partial), "-b", str(bits)]
        if rows:
            cmd += ["-cr", str(rows)]
    done = subprocess.run(cmd, stdout=sys.stderr, check=False)
    # The converter reports a bad argument on stdout and exits 0: trust only its output.
    if done.returncode != 0 or folder_format(partial) != "exl3":
        raise SystemExit(
            f"genq: error: exllamav3's converter did not finish (exit {done.returncode}); "
            "run the same command again to resume"
        )


def _resumable(job: Path, src: Path, partial: Path, bits: float) -> bool:
    try:
        args = json.loads((job / "args.json").read_text())
    except (OSError, ValueError):
        return False
    same = (args.get("in_dir"), args.get("out_dir"), args.get("bits"))
    return same == (str(src), str(partial), bits)
