"""Combinations of a case feature and a backend that are known to fail and
are skipped for now, each with the reason. The run summary lists how many
cases each entry skipped; an entry goes once its backend is fixed.

Features are the tags a generator puts on a case (`Case.features`, shown by
`python -m tests.pallas.fuzz --case SEED:INDEX`): e.g. `carry`,
`window_past_end`, `dot:int8->int32`, `op:invert:uint8`.
"""
from __future__ import annotations

_CARRY = ("scratch carried across an 'arbitrary' grid dim whose output block "
          "changes at every step starts fresh at every step")

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    ("carry", "interpret"): _CARRY,
    ("carry", "triton_interpret"): _CARRY,
    ("dma_double", "interpret"):
        "double-buffered DMA: the copy started at the previous grid step is "
        "lost",
    ("window_past_end", "interpret"):
        "a masked load/store through pl.ds past the array end is clamped "
        "like dynamic_slice instead of masked",
    ("window_past_end", "mosaic_interpret"):
        "a masked pl.ds window past the end of a whole-array ref fails at "
        "run time (out-of-bounds, raw JaxRuntimeError)",
    ("row_index:negative", "triton_interpret"):
        "x_ref[-k] reads outside the block",
    ("row_index:negative", "mosaic_interpret"):
        "x_ref[-k] fails at run time (out-of-bounds [-1:0])",
    ("dot:int8->int32", "triton_interpret"):
        "int8 x int8 -> int32 dot wraps at 8 bits",
    ("dot:float16->float32", "triton_interpret"):
        "f16 x f16 -> f32 dot rounds to f16",
    ("op:invert:uint8", "triton_interpret"):
        "~x on uint8 raises OverflowError in Triton's interpreter",
    ("cast_of_loop_index", "triton_interpret"):
        "program ids of grid dims run as loops (and fori indices) are Python "
        "ints in the generated code: .to() on them fails",
    ("atomic_broadcast_value", "triton_interpret"):
        "an atomic whose value is a broadcast scalar updates lane 0 only",
    ("masked_store_scalar_mask", "triton_interpret"):
        "a store mask broadcast from a scalar computed through float ops "
        "(floor of a program id) fails: TypeError: ufunc 'bitwise_and'",
    ("roll_by_0_or_size", "mosaic_interpret"):
        "jnp.roll by 0 or by the axis length: raw MLIRError (zero-size slice)",
}
KNOWN_FAILURES.update({
    (f"op:reduce_{kind}:uint8", "mosaic_interpret"):
        f"{kind} over an axis of uint8 compares as signed"
    for kind in ("min", "max", "argmin", "argmax")})


def known_failure(features, backend: str) -> str | None:
  """The reason `backend` is skipped for a case with `features`, or None."""
  for feature in sorted(features):
    reason = KNOWN_FAILURES.get((feature, backend))
    if reason:
      return f"{feature}: {reason}"
  return None
