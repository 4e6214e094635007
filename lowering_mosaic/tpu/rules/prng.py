"""The TPU's random numbers -> its hardware generator.

    tpu.prng_set_seed_32 %s0, %s1, ...      (i32 scalars: the seeds, mixed)
    %bits = tpu.prng_random_bits : vector<...xi32>

as Pallas's TPU lowering emits them. A draw is a vector of rank 2 or more
(Mosaic has no implicit dims for this op). The samplers (`stateful_*`) are
lax operations on the drawn words and need no rule of their own.

JAX's `threefry2x32` (the hash of `jax.random`'s default generator, which
`tpu.random.threefry` binds in its kernel) lowers to JAX's own definition of
the hash, its five rounds unrolled, inside a `threefry2x32` named scope
(`tpu.trace_start`/`trace_stop`), as Pallas lowers it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from dsl.core.jax_internals import ir, threefry2x32_hash, tpu
from jax.extend.random import threefry2x32_p

from dsl.tpu.prng import prng_random_bits_p, prng_seed_p
from lowering_mosaic.tpu import emit
from lowering_mosaic.tpu.rules import register


@register(prng_seed_p)
def _prng_seed(ctx, *seeds):
  for k, (seed, aval) in enumerate(zip(seeds, ctx.avals_in)):
    if aval.shape != () or not isinstance(seed.type, ir.IntegerType):
      raise ctx.error(f"seed {k} must be an integer scalar, got "
                      f"{aval.str_short()}")
  tpu.PRNGSeed32Op(list(seeds))
  return []


@register(prng_random_bits_p)
def _prng_random_bits(ctx, *, shape, dtype):
  if len(shape) < 2:
    raise ctx.error(f"a random draw of shape {tuple(shape)}: on a TPU a draw "
                    "has rank 2 or more, e.g. (8, 128); draw that and slice "
                    "or reshape it")
  return tpu.PRNGRandomBitsOp(emit.vtype(shape, jnp.int32)).result


def _unrolled_threefry(k1, k2, x1, x2):
  with jax.named_scope("threefry2x32"):
    return threefry2x32_hash(k1, k2, x1, x2, use_rolled_loops=False)


@functools.lru_cache(maxsize=64)
def _threefry_jaxpr(avals):
  return jax.make_jaxpr(_unrolled_threefry)(
      *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


@register(threefry2x32_p)
def _threefry2x32(ctx, k1, k2, x1, x2):
  closed = _threefry_jaxpr(tuple(ctx.avals_in))
  return ctx.lower_closed(closed, [k1, k2, x1, x2])
