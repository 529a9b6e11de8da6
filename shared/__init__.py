"""genq's contract, shared by every process: wire models and their codecs (`schemas`, `events`,
`records`), the Redis key builders (`keys`), the job's state transitions (Lua scripts in
`lua/` behind the typed calls of `transitions`), settings in sections, and the error tree.
A reader learns the whole protocol from this package; it imports neither `gateway` nor
`worker`."""

__version__ = "0.1.0"
