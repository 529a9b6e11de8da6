"""The exllamav3 engine: exllamav3's `Generator` behind genq's `Engine` protocol, for EXL3
models and plain fp16/bf16 folders.

- `engine`: cancel and step → StepOutputs and the free pages the worker admits jobs against,
  talking to the generator only through the few methods and attributes it uses (CPU tests
  drive it with a fake generator).
- `results`: exllamav3's result dicts (stages, end reasons, per-job errors) → StepOutputs.
- `sampling`: every job's explicit `ComboSampler`, and the check that exllamav3 takes each
  argument genq passes (its `Job` and `Generator` ignore unknown ones).
- `loader`: `load_backend` (model, cache, tokenizer, warm-up, generator and job factories),
  the generator's shape.

exllamav3 samples on the GPU itself (one fused kernel per job); from
`GENQ_BATCHED_SAMPLING_MIN_JOBS` jobs in a step genq samples them in one batched pass of the
exllamav2 engine's GPU sampler instead (`batch_sampling`; measured: docs/performance.md).
torch and exllamav3 are imported only inside `loader.load_backend`, so every module of this
package imports on a CPU install.
"""
