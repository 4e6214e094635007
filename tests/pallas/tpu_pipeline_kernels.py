"""Kernels and cases shared by the `tpu.emit_pipeline` tests: an outer
`pallas_call` (dsl or Pallas) with its operands in HBM and an inner pipeline
streaming their blocks through VMEM."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl
from dsl import tpu as dtpu
from tests.pallas.testing import matmul_kernel_for

TPU = {dsl: dtpu, jpl: jpltpu}
f32, bf16 = jnp.float32, jnp.bfloat16


def any_call(pl, kernel, out_shape, n_in, backend, scratch_shapes=()):
  """pallas_call of `pl` (dsl or Pallas) with every operand in HBM."""
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  # Pallas: its TPU interpret mode, or its TPU lowering for "mosaic"
  kw = ({"backend": backend} if pl is dsl else {} if backend == "mosaic"
        else {"interpret": jpltpu.InterpretParams(detect_races=True)})
  return pl.pallas_call(kernel, out_shape, in_specs=[any_spec] * n_in,
                        out_specs=any_spec, scratch_shapes=scratch_shapes,
                        **kw)


def matmul(pl, x, y, *, bm, bk, bn, backend=None, **pipeline_kw):
  """x @ y: the output block (i, j) accumulates over l in its buffer."""
  inner = matmul_kernel_for(pl)

  def kernel(x_hbm, y_hbm, o_hbm):
    m, k = x_hbm.shape
    n = y_hbm.shape[1]
    TPU[pl].emit_pipeline(
        inner, grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, l: (i, l)),
                  pl.BlockSpec((bk, bn), lambda i, j, l: (l, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, l: (i, j)),
        **pipeline_kw)(x_hbm, y_hbm, o_hbm)

  out = jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32)
  return any_call(pl, kernel, out, 2, backend)(x, y)


def elementwise(pl, x, y, *, bm, bn, backend=None):
  """2 x + y, with the blocks visited in reverse column order."""
  def inner(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + y_ref[...]

  def kernel(x_hbm, y_hbm, o_hbm):
    m, n = x_hbm.shape
    nj = n // bn
    spec = pl.BlockSpec((bm, bn), lambda i, j: (i, nj - 1 - j))
    TPU[pl].emit_pipeline(inner, grid=(m // bm, nj), in_specs=[spec, spec],
                          out_specs=[spec])(x_hbm, y_hbm, o_hbm)

  return any_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 2,
               backend)(x, y)


def inputs(shapes, dtype):
  """Normal random arrays of `shapes` in `dtype` (the same each call)."""
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(dtype)
          for k, s in zip(keys, shapes)]


MATMULS = {   # name -> (m, k, n), (bm, bk, bn), dtype
    "f32_2x2x2": ((16, 256, 256), (8, 128, 128), f32),
    "bf16_2x3x1": ((32, 384, 128), (16, 128, 128), bf16),
    "f32_one_step": ((8, 128, 128), (8, 128, 128), f32),
}
ELEMENTWISE = {   # name -> shape, block, dtype
    "f32_3x2": ((24, 256), (8, 128), f32),
    "bf16_1x4": ((16, 512), (16, 128), bf16),
}


def matmul_case(name, table=None):
  """x, y, the blocks and jnp's answer of MATMULS[name] (or table's)."""
  (m, k, n), (bm, bk, bn), dtype = (table or MATMULS)[name]
  x, y = inputs([(m, k), (k, n)], dtype)
  want = jnp.dot(x, y, precision="highest", preferred_element_type=f32)
  return x, y, dict(bm=bm, bk=bk, bn=bn), want


def elementwise_case(name, table=None):
  """x, y, the blocks and jnp's answer of ELEMENTWISE[name]."""
  shape, (bm, bn), dtype = (table or ELEMENTWISE)[name]
  x, y = inputs([shape, shape], dtype)
  return x, y, dict(bm=bm, bn=bn), x * 2 + y
