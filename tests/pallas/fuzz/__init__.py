"""A differential fuzzer: seeded random kernels run on every CPU backend, on
Pallas's interpret mode and on a numpy reference (docs/fuzzing.md).

    python -m tests.pallas.fuzz --seed S --n N
    python -m tests.pallas.fuzz --case S:I [--verbose] [--minimize BACKEND]

Modules: `spec` (a case as data), `expr` (random expressions and their
evaluation), `family_*` (kernel families, `families` their table), `render`
(a case as a pallas_call for dsl or Pallas), `reference` (the numpy run),
`runner` (one case on every backend), `driver` (many cases in worker
processes, the summary), `minimize`, `known_failures`.
"""
