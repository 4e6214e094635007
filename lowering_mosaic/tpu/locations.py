"""The MLIR locations of the Mosaic lowering's operations, as Pallas's.

An equation's location is JAX's (`mlir.source_info_to_location`, as in
StableHLO): `"prim:"("scope/prim"(frames))`, where `frames` are the user's
frames of the equation's traceback (a callsite chain, innermost first;
unknown without one).

Pallas's TPU lowering then caches the lowering of most equations: the
operations of the first equation with a given key (primitive, avals, params,
block shapes) are emitted once as a function and inlined at every equation
with that key, and inlining rewrites their locations to
`"prim:"("scope/prim/first scope/prim"(callsite(first frames at frames)))`.
The cache lives as long as the StableHLO module being lowered, so it spans
the kernels of one `jax.jit`. `LocationCache` follows that behaviour, so
that our operations carry the locations Pallas's carry (which a TPU
profiler shows, and which jax 0.12 ships in the call's `debug_locations`).

Constants for an equation's literal operands are made before the cached
part, at the equation's own location; an equation is not cached when it is
one of Pallas's uncached higher-order primitives, when one of its operands
stays a literal (the primitives whose Pallas rules take Python scalars), or
when a key cannot be formed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dsl.core.jax_internals import core, ir, mlir, source_info_util

# Primitives whose lowerings Pallas never caches (they lower inner jaxprs).
UNCACHED = frozenset({"while", "scan", "cond", "run_scoped", "jit", "pjit",
                      "custom_jvp_call", "custom_vjp_call", "num_programs"})

# Primitives whose Pallas rules take literal operands as Python values: an
# equation of one with a literal operand is not cached.
LITERALS_KEPT = frozenset({
    "get", "swap", "load", "add", "add_any", "max", "min", "sub", "mul", "div",
    "rem", "neg", "and", "or", "xor", "argmax", "argmin", "top_k",
    "approx_top_k", "pow", "exp2", "atan2"})

# Primitives whose cached lowering also takes the grid indices.
NEEDS_GRID = frozenset({"semaphore_signal", "dma_start", "dma_wait",
                        "program_id", "axis_index"})


@dataclasses.dataclass
class LocationCache:
  """The first equation of each lowering-cache key: its name stack and
  traceback (locations are remade in each kernel's MLIR context)."""
  first: dict = dataclasses.field(default_factory=dict)


def for_module(module_context) -> LocationCache:
  """The cache of the StableHLO module being lowered (one per module, as
  Pallas's), or a fresh one."""
  store = getattr(module_context, "pallas_lowering_cache", None)
  if store is None:
    return LocationCache()
  return store.setdefault(LocationCache, LocationCache())


def _frames(lctx, traceback) -> ir.Location:
  return mlir.source_info_to_location(
      lctx, None, source_info_util.NameStack(), traceback)


def _eqn_name(eqn) -> str:
  stack = eqn.source_info.name_stack
  return f"{stack}/{eqn.primitive.name}" if stack.stack else eqn.primitive.name


def equation_location(lctx, eqn) -> ir.Location:
  """JAX's location of an equation."""
  return mlir.source_info_to_location(lctx, eqn.primitive,
                                      eqn.source_info.name_stack,
                                      eqn.source_info.traceback)


def _key(lctx, eqn, invals, block_shape) -> Any:
  name = eqn.primitive.name
  if name in UNCACHED:
    return None
  if name in LITERALS_KEPT and any(isinstance(v, core.Literal)
                                   for v in eqn.invars):
    return None
  key = (eqn.primitive, tuple(v.aval for v in eqn.invars),
         tuple(v.aval for v in eqn.outvars),
         tuple(sorted(eqn.params.items())),
         tuple(block_shape(x) for x in invals),
         len(lctx.grid) if name in NEEDS_GRID else 0, tuple(lctx.grid))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def rule_location(lctx, eqn, invals, block_shape) -> ir.Location | None:
  """Where the operations of `eqn`'s rule go when Pallas would inline them
  from its cache, else None (they take the equation's location)."""
  key = _key(lctx, eqn, invals, block_shape)
  if key is None:
    return None
  first = lctx.location_cache.first.setdefault(key, eqn)
  name = f"{_eqn_name(eqn)}/{_eqn_name(first)}"
  frames = ir.Location.callsite(_frames(lctx, first.source_info.traceback),
                                [_frames(lctx, eqn.source_info.traceback)])
  return ir.Location.name(f"{eqn.primitive.name}:",
                          childLoc=ir.Location.name(name, childLoc=frames))
