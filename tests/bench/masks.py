"""What a decode step's token masks cost the GPU engines' host side (worker/dyngen/masks.py),
without a GPU: N jobs under `genq.benchgpu`'s JSON schema, each at its own place in the
document (a random walk over the allowed tokens, as a random-weight model takes), their masks
written by llguidance's pool into one buffer per step (`fill_masks`, the call the engines'
hook makes while the forward pass runs), then each job's token fed to its matcher after the
step: every other step one `consume` per job (as the engines do, `StepMasks.consume`), the
others all in one parallel call on llguidance's threads (`consume_token_par`, for comparison).

    python -m tests.bench.masks (--synth 8b | --tokenizer DIR/tokenizer.json [--vocab 128256])
        [--rows 1,64,256] [--steps 100] [--threads N]

`--synth SHAPE`: the tokenizer `genq synth-model --shape SHAPE` trains (the same corpus and
size; no weights written), over that shape's logits width.

Prints JSON per row count: milliseconds per step for the masks (p50, p90) and for the
consumes (one call per job, and one call for all), and per row.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance

from genq.benchgpu import BENCH_SCHEMA
from genq.synth import CORPUS_BYTES, SHAPES, train_tokenizer
from shared.constraints import grammar_of
from worker.constraint import Grammars, JobMatcher, allowed_ids
from worker.dyngen.masks import fill_masks, mask_threads, mask_words

WALK_STEPS = 200
"""Tokens of the random walk that places the jobs: through the short fields into `body`."""


def eos_ids(tokenizer_json: str) -> list[int]:
    """The synth models' EOS tokens (`genq synth-model`), else the tokenizer's `</s>`."""
    vocab: dict[str, int] = json.loads(tokenizer_json)["model"]["vocab"]
    names = ("<|end_of_text|>", "<|eot_id|>", "</s>")
    return [vocab[n] for n in names if n in vocab]


def placed(g: Grammars, grammar: str, eos: list[int], vocab: int, rng: random.Random) -> JobMatcher:
    """A matcher some random number of tokens into the document."""
    m = g.matcher(grammar)
    for _ in range(rng.randrange(WALK_STEPS)):
        allowed = [t for t in allowed_ids(m.allowed_bits(), vocab) if t not in eos]
        if not allowed or not m.consume(rng.choice(allowed)):
            break
    return m


def measure(g: Grammars, rows: int, steps: int, threads: int, eos: list[int]) -> dict[str, Any]:
    rng = random.Random(rows)
    grammar = grammar_of("json_schema", BENCH_SCHEMA)
    vocab = g.vocab_size
    matchers = [placed(g, grammar, eos, vocab, rng) for _ in range(rows)]
    words = mask_words(vocab)
    buf = (ctypes.c_int32 * (words * rows))()
    pool = llguidance.LLExecutor(threads)
    fills: list[float] = []
    consumes: list[float] = []
    together: list[float] = []
    for step in range(steps):
        t = time.perf_counter()
        fill_masks(pool, matchers, ctypes.addressof(buf), words, rows)
        fills.append(time.perf_counter() - t)
        raw = bytes(buf)
        tokens = []
        for i in range(rows):
            allowed = allowed_ids(raw[i * words * 4 : (i + 1) * words * 4], vocab)
            tokens.append(rng.choice([a for a in allowed if a not in eos] or allowed))
        started = time.perf_counter()
        if step % 2:
            pool.consume_token_par(
                [(m.m, token) for m, token in zip(matchers, tokens, strict=True)]
            )
            together.append(time.perf_counter() - started)
        else:
            for m, token in zip(matchers, tokens, strict=True):
                m.consume(token)
            consumes.append(time.perf_counter() - started)
    return {
        "rows": rows,
        "threads": threads,
        "vocab": vocab,
        "masks_ms_p50": ms(statistics.median(fills)),
        "masks_ms_p90": ms(sorted(fills)[int(0.9 * len(fills))]),
        "consume_ms_p50": ms(statistics.median(consumes)),
        "consume_together_ms_p50": ms(statistics.median(together)) if together else None,
        "masks_us_per_row": round(statistics.median(fills) / rows * 1e6, 1),
    }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.masks", description=__doc__)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", help="a tokenizer.json")
    source.add_argument("--synth", choices=sorted(SHAPES), help="a synth model shape's tokenizer")
    p.add_argument("--vocab", type=int, help="the model's logits width (default: the tokenizer's)")
    p.add_argument("--rows", default="1,64,256")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=mask_threads())
    a = p.parse_args(argv)
    vocab = a.vocab
    if a.synth:
        shape = SHAPES[a.synth]
        tokenizer_json = train_tokenizer(shape.tokenizer_vocab, CORPUS_BYTES[a.synth]).to_str()
        vocab = vocab or shape.vocab
    else:
        tokenizer_json = Path(a.tokenizer).read_text()
    eos = eos_ids(tokenizer_json)
    g = Grammars(tokenizer_json, eos, vocab)
    for rows in (int(x) for x in a.rows.split(",")):
        print(json.dumps(measure(g, rows, a.steps, a.threads, eos)), flush=True)


if __name__ == "__main__":
    main()
