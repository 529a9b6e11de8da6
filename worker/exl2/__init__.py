"""The exllamav2 engine: `ExLlamaV2DynamicGenerator` behind genq's `Engine` protocol.

- `engine`: admission, cancel and step → StepOutputs, talking to the generator only through
  the few methods and attributes it uses (CPU tests drive it with a fake generator).
- `results`: exllamav2's result dicts → text, token ids and logprobs.
- `loader`: `load_backend` (model, cache, tokenizer, generator and job factories),
  `build_card`, cache sizing.
- `gpu_sampling`: sampling on the GPU in one batched pass per decode step.

torch and exllamav2 are imported only here, and only inside functions of `loader` and
`gpu_sampling`, so every module of this package imports on a CPU install.
"""
