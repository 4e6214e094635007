"""Kernels written once against a `pl` / `pltpu` module pair, so the same
code runs with `dsl` / `dsl.tpu` and with `jax.experimental.pallas` /
`.tpu`. Each case is `case(pl, pltpu) -> (f, args)`; the golden test lowers
`f(*args)` for a TPU with both and compares the Mosaic modules. This module
has the grids, block dims, memory spaces, control flow and dots;
mosaic_corpus_dma.py, mosaic_corpus_values.py, mosaic_corpus_more.py and
mosaic_corpus_library.py (the kernels of kernels/) add theirs to CASES.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tests.pallas.testing import matmul_call

CASES = {}


def case(fn):
  CASES[fn.__name__] = fn
  return fn


def f32(*shape):
  return jnp.ones(shape, jnp.float32)


def sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def api(pl, pltpu, name):
  """`pl.<name>` (where JAX 0.11 has the semaphore functions and
  DeviceIdType), else `pltpu.<name>`."""
  return getattr(pl, name, None) or getattr(pltpu, name)


# ------------------------------------------------------------ grids

@case
def add_1d_parallel(pl, pltpu):
  def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(add_kernel, sds((64, 128)), grid=(8,),
                     in_specs=[spec, spec], out_specs=spec,
                     compiler_params=pltpu.CompilerParams(
                         dimension_semantics=("parallel",)))
  return f, (f32(64, 128), f32(64, 128))


@case
def scale_2d_arbitrary(pl, pltpu):
  def scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0
  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = pl.pallas_call(scale_kernel, sds((32, 256)), grid=(4, 2),
                     in_specs=[spec], out_specs=spec)
  return f, (f32(32, 256),)


@case
def matmul_3d_grid(pl, pltpu):
  f = matmul_call(
      pl, pltpu, 256, 256, 256, (128, 128, 128), scratch=True,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")))
  return f, (f32(256, 256), f32(256, 256))


# ------------------------------------------------------------ block dims

@case
def squeezed_leading_dim(pl, pltpu):
  def squeeze_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  spec = pl.BlockSpec((None, 8, 128), lambda b, i: (b, i, 0))
  f = pl.pallas_call(squeeze_kernel, sds((4, 16, 128)), grid=(4, 2),
                     in_specs=[spec], out_specs=spec)
  return f, (f32(4, 16, 128),)


@case
def element_rows(pl, pltpu):
  def element_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3.0
  f = pl.pallas_call(
      element_kernel, sds((64, 128)), grid=(8,),
      in_specs=[pl.BlockSpec((pl.Element(8), pl.Element(128)),
                             lambda i: (i * 8, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
  return f, (f32(64, 128),)


@case
def whole_array_no_grid(pl, pltpu):
  def whole_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])
  f = pl.pallas_call(whole_kernel, sds((16, 128)))
  return f, (f32(16, 128),)


@case
def grid_invariant_block(pl, pltpu):
  def bias_kernel(x_ref, b_ref, o_ref):
    o_ref[...] = x_ref[...] + b_ref[...]
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(bias_kernel, sds((64, 128)), grid=(8,),
                     in_specs=[spec, pl.BlockSpec((8, 128), lambda i: (0, 0))],
                     out_specs=spec)
  return f, (f32(64, 128), f32(8, 128))


# ------------------------------------------------------------ memory spaces

@case
def smem_scalars(pl, pltpu):
  def smem_kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * s_ref[0] + s_ref[1]
  f = pl.pallas_call(
      smem_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM))
  return f, (jnp.ones((2,), jnp.float32), f32(8, 128))


@case
def scalar_prefetch(pl, pltpu):
  def gather_kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + idx_ref[pl.program_id(0)].astype(jnp.float32)
  f = pl.pallas_call(
      gather_kernel, sds((32, 128)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))))
  return f, (jnp.array([3, 2, 1, 0], jnp.int32), f32(32, 128))


@case
def aliased_output(pl, pltpu):
  def inc_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(inc_kernel, sds((16, 128)), grid=(2,),
                     in_specs=[spec], out_specs=spec,
                     input_output_aliases={0: 0})
  return f, (f32(16, 128),)


@case
def dma_any_grid_free(pl, pltpu):
  def copy_kernel(x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm, buf, sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...] * 2.0
  f = pl.pallas_call(
      copy_kernel, sds((16, 128)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA])
  return f, (f32(16, 128),)


# ------------------------------------------------------------ control flow

@case
def fori_and_while(pl, pltpu):
  def loop_kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[...] * i.astype(jnp.float32)
    acc = lax.fori_loop(0, 4, body, jnp.zeros((8, 128), jnp.float32))

    def cond(c):
      return c[0] < 3

    def wbody(c):
      return c[0] + 1, c[1] * 2.0
    _, acc = lax.while_loop(cond, wbody, (jnp.int32(0), acc))
    o_ref[...] = acc
  f = pl.pallas_call(loop_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def reductions(pl, pltpu):
  def reduce_kernel(x_ref, s_ref, m_ref):
    x = x_ref[...]
    s_ref[...] = jnp.sum(x, axis=1, keepdims=True) + jnp.zeros((8, 128))
    m_ref[...] = jnp.max(x, axis=0, keepdims=True) + jnp.zeros((8, 128))
  f = pl.pallas_call(reduce_kernel, (sds((8, 128)), sds((8, 128))))
  return f, (f32(8, 128),)


def _dot_case(dims):
  def build(pl, pltpu):
    def dot_kernel(x_ref, y_ref, o_ref):
      o_ref[...] = lax.dot_general(x_ref[...], y_ref[...], (dims, ((), ())),
                                   preferred_element_type=jnp.float32)
    f = pl.pallas_call(dot_kernel, sds((128, 128)))
    return f, (f32(128, 128), f32(128, 128))
  return build


CASES["dot_nn"] = _dot_case(((1,), (0,)))
CASES["dot_nt"] = _dot_case(((1,), (1,)))
CASES["dot_tn"] = _dot_case(((0,), (0,)))
CASES["dot_tt"] = _dot_case(((0,), (1,)))


@case
def iota_roll_casts(pl, pltpu):
  def misc_kernel(x_ref, o_ref, b_ref):
    x = x_ref[...]
    i = lax.broadcasted_iota(jnp.int32, (8, 128), 1)
    y = pltpu.roll(x, 3, 1) + i.astype(jnp.float32)
    o_ref[...] = y.astype(jnp.bfloat16)
    b_ref[...] = (x > 0).astype(jnp.int8)
  f = pl.pallas_call(misc_kernel, (sds((8, 128), jnp.bfloat16),
                                   sds((8, 128), jnp.int8)))
  return f, (f32(8, 128),)


def _buffered_case(**mode):
  def build(pl, pltpu):
    def buffered_kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2.0
    f = pl.pallas_call(
        buffered_kernel, sds((32, 128)), grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0),
                               pipeline_mode=pl.Buffered(**mode))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
    return f, (f32(32, 128),)
  return build


# Both lowerings reject these (test_mosaic_golden.REJECTED_BY_BOTH).
CASES["buffered_three"] = _buffered_case(buffer_count=3)
CASES["buffered_lookahead"] = _buffered_case(buffer_count=2,
                                             use_lookahead=True)


# The rest of the corpus registers itself into CASES.
from tests.pallas import mosaic_corpus_dma  # noqa: E402,F401
from tests.pallas import mosaic_corpus_library  # noqa: E402,F401
from tests.pallas import mosaic_corpus_values  # noqa: E402,F401
from tests.pallas import mosaic_corpus_more  # noqa: E402,F401
from tests.pallas import mosaic_corpus_prng  # noqa: E402,F401
from tests.pallas import mosaic_corpus_named  # noqa: E402,F401
