"""Primitives whose JAX batching leaves operands the JAX lowering cannot
take, rewritten before the interpret backend vectorizes a kernel over its
parallel grid dims (`jax.vmap`).

`threefry2x32` broadcasts its four operands (Pallas's TPU threefry kernel
passes (1, 1) keys with a block of counts). Its batching rule only moves
batch dims to the front, so under vmap a count block computed per grid
point (batched) and one that is not (`zeros_like`) differ in their leading
dim, and the CPU lowering's rolled loop then carries words of different
shapes, which `fori_loop` refuses. The rule here batches every operand the
same way first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from dsl.core.jax_internals import ClosedJaxpr
from dsl.core.normalize import rewrite_closed


@jax.custom_batching.custom_vmap
def _threefry2x32(k1, k2, x1, x2):
  args = (k1, k2, x1, x2)
  shape = jnp.broadcast_shapes(*(a.shape for a in args))
  return tuple(threefry2x32_p.bind(*(jnp.broadcast_to(a, shape)
                                     for a in args)))


@_threefry2x32.def_vmap
def _threefry2x32_vmap(axis_size, in_batched, *args):
  args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
          for a, batched in zip(args, in_batched)]
  return _threefry2x32(*args), (True, True)


def _threefry2x32_rule(k1, k2, x1, x2):
  return list(_threefry2x32(k1, k2, x1, x2))


# primitive -> fn(*operands, **params) giving its results.
RULES = {threefry2x32_p: _threefry2x32_rule}


@functools.lru_cache(maxsize=256)
def vectorizable(jaxpr: ClosedJaxpr) -> ClosedJaxpr:
  """`jaxpr` (a discharged kernel) with the primitives of RULES rewritten so
  that `jax.vmap` over it lowers."""
  return rewrite_closed(jaxpr, RULES)
