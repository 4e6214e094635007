"""Combinations of a case feature and a backend that are known to fail and
are skipped for now, each with the reason. The run summary lists how many
cases each entry skipped; an entry goes once its backend is fixed.

Features are the tags a generator puts on a case (`Case.features`, shown by
`python -m tests.pallas.fuzz --case SEED:INDEX`): e.g. `carry`,
`window_past_end`, `dot:int8->int32`, `op:invert:uint8`.
"""
from __future__ import annotations

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    ("dma_double", "interpret"):
        "double-buffered DMA: the copy started at the previous grid step is "
        "lost",
    ("window_past_end", "mosaic_interpret"):
        "a masked pl.ds window past the end of a whole-array ref fails at "
        "run time (out-of-bounds, raw JaxRuntimeError)",
    ("row_index:negative", "mosaic_interpret"):
        "x_ref[-k] fails at run time (out-of-bounds [-1:0])",
    ("cast_of_loop_index", "triton_interpret"):
        "program ids of grid dims run as loops (and fori indices) are Python "
        "ints in the generated code: .to() on them fails",
    ("atomic_broadcast_value", "triton_interpret"):
        "an atomic whose value is a broadcast scalar updates lane 0 only",
    ("masked_store_scalar_mask", "triton_interpret"):
        "a store mask broadcast from a scalar computed through float ops "
        "(floor of a program id) fails: TypeError: ufunc 'bitwise_and'",
}


def known_failure(features, backend: str) -> str | None:
  """The reason `backend` is skipped for a case with `features`, or None."""
  for feature in sorted(features):
    reason = KNOWN_FAILURES.get((feature, backend))
    if reason:
      return f"{feature}: {reason}"
  return None
