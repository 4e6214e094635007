"""benchmarks: the benchmark CLI (`python -m benchmarks`, `dsl-bench`).

Every measured row runs a kernel through one `dsl` backend and, in the same
run, its peers: XLA's plain-jnp version, `jax.experimental.pallas` running the
same kernel source, and on GPUs a hand-written Triton kernel. See
docs/benchmarks.md. `benchmarks.autotune.lookup` gives the autotuned block
configuration of a kernel and size (it imports neither dsl nor jax).
"""
