"""What checking a constraint costs the gateway: a 50-property JSON schema compiled and checked
cold (a schema it has not seen) and cached (the same schema again), through the gateway's own
`ConstraintChecker`, on the sim model's tokenizer and, with --tokenizer, on a real-sized one
(a `genq synth-model` folder's tokenizer.json: 128k tokens for --shape 8b).

    python -m tests.bench.constraints [--rounds 50] [--tokenizer DIR/tokenizer.json]
                                      [--patterns K]

`--patterns K`: K of the string properties carry a `pattern` (an id, an e-mail, a date, …),
each of which the check also builds and walks on its own.

Prints JSON: median and p90 milliseconds per check, cold and cached, per tokenizer; and the
cold check's median CPU time (this process's, its threads' too: steadier than the wall clock
on a box other work shares).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Tokenizer

from gateway.constraints import ConstraintChecker
from gateway.registry import LoadedCard
from shared.schemas import ModelCard
from shared.settings import Settings
from worker.sim import SimEngine

T = TypeVar("T")


PATTERNS = (
    r"^[A-Z]{2}-\d{4}$",
    r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$",
    r"^\d{4}-\d{2}-\d{2}$",
    r"^\+?[0-9 ()-]{7,20}$",
    r"^[a-f0-9]{32}$",
)
"""Regexes as apps' schemas hold them (a code, an e-mail, a date, a phone number, a hash)."""


def schema(n_props: int, salt: int, patterns: int = 0) -> dict[str, Any]:
    """An object of `n_props` properties of mixed types (strings, numbers, enums, arrays,
    nested objects), the first `patterns` of them strings with a `pattern`; `salt` changes one
    name, so each salt is a schema not seen before."""
    types: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 64},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    ]
    props = {f"field_{i}": types[i % len(types)] for i in range(n_props)}
    for i in range(patterns):
        props[f"field_{i}"] = {"type": "string", "pattern": PATTERNS[i % len(PATTERNS)]}
    props[f"salt_{salt}"] = {"type": "string"}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


async def _inline(work: Callable[[], T], size: int | None) -> T:
    return work()


async def measure(loaded: LoadedCard, rounds: int, patterns: int) -> dict[str, float]:
    checker = ConstraintChecker(Settings())
    await checker.check(loaded, "json_schema", schema(50, -1), "json_schema", _inline)  # tokenizer
    cold, cold_cpu, cached = [], [], []
    for i in range(rounds):
        s = schema(50, i, patterns)
        t0, c0 = time.perf_counter(), time.process_time()
        await checker.check(loaded, "json_schema", s, "json_schema", _inline)
        cold.append(time.perf_counter() - t0)
        cold_cpu.append(time.process_time() - c0)
        t0 = time.perf_counter()
        await checker.check(loaded, "json_schema", s, "json_schema", _inline)
        cached.append(time.perf_counter() - t0)

    def ms(v: list[float], q: int) -> float:
        return round(statistics.quantiles(v, n=10)[q - 1] * 1000 if q < 10 else max(v) * 1000, 3)

    return {
        "vocab": loaded.tokenizer.get_vocab_size(),
        "cold_ms_p50": round(statistics.median(cold) * 1000, 3),
        "cold_ms_p90": ms(cold, 9),
        "cold_cpu_ms_p50": round(statistics.median(cold_cpu) * 1000, 3),
        "cached_ms_p50": round(statistics.median(cached) * 1000, 4),
        "cached_ms_p90": ms(cached, 9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tokenizer", help="a tokenizer.json (a genq synth-model folder's)")
    ap.add_argument("--patterns", type=int, default=0, help="string properties with a pattern")
    args = ap.parse_args()
    sim = SimEngine()
    loaded = [LoadedCard(sim.card, Tokenizer.from_str(sim.tokenizer_json))]
    if args.tokenizer:
        tok = Tokenizer.from_file(args.tokenizer)
        raw = Path(args.tokenizer).read_text()
        card = ModelCard(
            name="real",
            engine="exllamav2",
            max_seq_len=8192,
            max_batch=64,
            tokenizer_sha=str(hash(raw)),
            eos_token_ids=[0],
        )
        loaded.append(LoadedCard(card, tok))
    out = {c.card.name: asyncio.run(measure(c, args.rounds, args.patterns)) for c in loaded}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
