"""Every benchmark command imports: they are run by hand (and on the GPU machine), not by the
suite, so a rename elsewhere breaks one silently (tests/bench/batch.py imported `percentile`
from where it no longer lives)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.bench
import tests.chaos

BENCHMARKS = [
    *(f"tests.bench.{m.name}" for m in pkgutil.iter_modules(tests.bench.__path__)),
    *(
        f"tests.chaos.{m.name}"
        for m in pkgutil.iter_modules(tests.chaos.__path__)
        if m.name.startswith("bench_")
    ),
    "genq.bench",
    "genq.benchgpu",
]


@pytest.mark.parametrize("module", BENCHMARKS)
def test_the_benchmark_imports(module: str) -> None:
    assert hasattr(importlib.import_module(module), "main")
