"""dsl's core: the kernel language, the grid model (BlockSpec/GridSpec ->
BlockMapping/GridMapping and every analysis a backend asks of it), the
`pallas_call` primitive, the backend registry, errors and options.

Nothing here imports dsl's front ends (`dsl.tpu`, `dsl.triton`), its tools,
transformations or backends; they build on it."""
