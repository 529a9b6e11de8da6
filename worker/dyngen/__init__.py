"""What genq's two dynamic-generator engines share: exllamav2's `ExLlamaV2DynamicGenerator`
(worker/exl2) and exllamav3's `Generator` (worker/exl3) take jobs, step them all at once and
report per-job result dicts of one shape, so most of an engine over either is the same.

- `engine`: `DynamicEngine`, the `Engine` protocol over a generator: job bookkeeping, the
  size check, admission's free pages, cancel, step, reset and close; each engine adds how its
  generator names a job and reads its pages.
- `results`: a "streaming" result dict → a StepOutput (text, token ids, finish reason,
  usage, logprobs).
- `backend`: `Backend` (the generator and job factories an engine loads), cache sizing, the
  token-piece lookup.
- `card`: the model card from a model folder.
- `batch_pass`: the batched sampling pass both engines can run after a decode step: which
  rows it samples (`plan_rows`) and the pass itself (`pick_on_device`).

An engine package imports its own library and this package, never the other engine. Nothing
here imports torch or either library at module level, so it all loads on a CPU install.
"""
