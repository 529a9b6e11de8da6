"""genq's command line and the tools that start or drive both sides: `genq serve`, the worker
launcher, `genq submit`, `genq bench`, the GPU benchmark, `genq synth-model`.

The only package that may import both `gateway` and `worker`."""
