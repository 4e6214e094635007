"""Combinations of a case feature and a backend that are known to fail and
are skipped for now, each with the reason. The run summary lists how many
cases each entry skipped; an entry goes once its backend is fixed.

Features are the tags a generator puts on a case (`Case.features`, shown by
`python -m tests.pallas.fuzz --case SEED:INDEX`): e.g. `carry`,
`window_past_end`, `dot:int8->int32`, `op:invert:uint8`.
"""
from __future__ import annotations

KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def known_failure(features, backend: str) -> str | None:
  """The reason `backend` is skipped for a case with `features`, or None."""
  for feature in sorted(features):
    reason = KNOWN_FAILURES.get((feature, backend))
    if reason:
      return f"{feature}: {reason}"
  return None
