"""The exllamav2 engine: `ExLlamaV2DynamicGenerator` behind genq's `Engine` protocol.

- `engine`: `worker.dyngen`'s `DynamicEngine` over exllamav2's generator: how its results
  name a job, its pages (CPU tests drive it with a fake generator).
- `loader`: `load_backend` (model, cache, tokenizer, generator and job factories), forward
  sizes, the sampler settings.
- `gpu_sampling`: sampling on the GPU in one batched pass per decode step.

What both dynamic-generator engines share (job bookkeeping, result dicts → StepOutputs, the
model card, cache sizing, the batched sampling pass) is `worker.dyngen`'s.

torch and exllamav2 are imported only here, and only inside functions of `loader` and
`gpu_sampling`, so every module of this package imports on a CPU install.
"""
