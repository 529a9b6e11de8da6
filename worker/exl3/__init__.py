"""The exllamav3 engine: exllamav3's `Generator` behind genq's `Engine` protocol, for EXL3
models and plain fp16/bf16 folders.

- `engine`: `worker.dyngen`'s `DynamicEngine` over exllamav3's generator: jobs keyed by
  serial, its page table, per-job errors, closing a failed generator (CPU tests drive it
  with a fake generator).
- `results`: exllamav3's result dicts (stages, end reasons, per-job errors) → StepOutputs.
- `sampling`: every job's explicit `ComboSampler`, and the check that exllamav3 takes each
  argument genq passes (its `Job` and `Generator` ignore unknown ones).
- `loader`: `load_backend` (model, cache, tokenizer, warm-up, generator and job factories),
  the generator's shape.

exllamav3 samples on the GPU itself (one fused kernel per job); from
`GENQ_BATCHED_SAMPLING_MIN_JOBS` jobs in a step genq samples them in one batched pass instead
(`batch_sampling`, on the pass both engines share: `worker.dyngen.batch_pass`; measured:
docs/performance.md). What both dynamic-generator engines share is `worker.dyngen`'s; this
package never imports the exllamav2 engine's. torch and exllamav3 are imported only inside
functions, so every module of this package imports on a CPU install.
"""
