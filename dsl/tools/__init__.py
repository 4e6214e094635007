"""dsl's tools: what a user runs beside kernels (autotuning, timing,
profiling, the shipped GPU defaults) and the commands that keep docs in
step with the code (`python -m dsl.tools.primitives_page`)."""
