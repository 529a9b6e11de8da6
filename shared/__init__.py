"""genq's shared contract: wire schemas, Redis keys, settings and errors. Structs, not logic."""

__version__ = "0.1.0"
