"""Windows a Mosaic lowering places at run time and cannot check.

Neither Mosaic target checks a window when the kernel runs: a `pl.ds`
start or an index computed at run time becomes the offset of a vector
access or a memref view, and where it leaves its ref the access reads and
writes whatever lies there (Pallas's TPU and Mosaic GPU lowerings do the
same). The access model (`dsl.core.access`), with the range analysis's
proofs attached, says which accesses may leave their ref at such a place:
their run-time exits (`run_time_exits`).

Without runtime asserts a lowering emits those windows as they are. With
jax_pallas_enable_runtime_assert on, every backend must make such an
access an error; the hardware cannot, so the lowering for the hardware
refuses the kernel (`refusal`), naming the ref, the dims and sides it may
leave on, and the user's line. The Mosaic interpreter (backend
"mosaic_interpret") checks every lane itself and needs no refusal.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from dsl.core.access import BELOW, Exit, RefAccess
from dsl.core.errors import BackendError
from dsl.core.jax_internals import state_indexing as indexing
from dsl.core.ranges import analyze_kernel


def run_time_exits(spec, eqn, transforms: Sequence, shape: Sequence,
                   static: Callable[[Any], int | None]) -> tuple[Exit, ...]:
  """Where the access of `eqn` (a ref of `shape` through `transforms`)
  may leave its ref at a place computed at run time, on the sides the
  range analysis of `spec` does not prove inside. The first indexer
  places the window; later ones only narrow it."""
  transforms = [t for t in transforms or () if t is not None]
  if not transforms or not isinstance(transforms[0], indexing.NDIndexer):
    return ()
  access = RefAccess.of(transforms[0], shape, static=static)
  if not access.leaving_dims(static=False):
    return ()
  proofs = analyze_kernel(spec).access(eqn) if spec is not None else None
  if proofs is not None and len(transforms) == 1:
    access = access.proving(proofs.inside_ref)
  return tuple(e for e in access.exits() if not e.static)


def ref_label(spec, ref) -> str:
  """The user's name of a kernel ref (a variable of `spec`'s jaxpr), as
  messages name it; "a ref" for one the kernel made itself."""
  invars = spec.jaxpr.jaxpr.invars
  n_ids = len(invars) - len(spec.ref_labels())
  labels = dict(zip(invars[n_ids:], spec.ref_labels()))
  return labels.get(ref, "a ref")


def _sides(exits: Sequence[Exit]) -> str:
  return ", ".join(
      f"dim {e.dim} {'below 0' if e.side == BELOW else 'past its end'}"
      for e in exits)


def refusal(kernel: str, target: str, ref: str, exits: Sequence[Exit],
            line: str | None, elsewhere: str) -> BackendError:
  """The error of a window `target` cannot check (see the module doc);
  `elsewhere`: the backends that check it."""
  return BackendError(
      kernel, f"jax_pallas_enable_runtime_assert is on, but a window of "
      f"{ref or 'a ref'} is placed at run time and may leave it "
      f"({_sides(exits)}): the range analysis does not prove it inside, and "
      f"{target} checks no window when the kernel runs. Bound the start "
      f"(e.g. with jnp.clip) so that it is proven inside, run the kernel "
      f"with {elsewhere}, which check every lane, or turn runtime asserts "
      "off", line, operand=ref or None)
