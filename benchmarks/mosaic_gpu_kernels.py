"""Sample kernels for backend "mosaic_gpu", with jnp references: the CPU
tests check how they lower, the GPU tests and scripts/mosaic_gpu_export.py
check their numerics on a Hopper GPU."""
import functools

import jax
import jax.numpy as jnp

import dsl as pl


def _add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.exp(x_ref[...]) + y_ref[...] * 2.0


def add(x, y, block=(128, 64), backend="mosaic_gpu"):
  spec = pl.BlockSpec(block, lambda i: (i, 0))
  return pl.pallas_call(_add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // block[0],), in_specs=[spec, spec],
                        out_specs=spec, backend=backend)(x, y)


def _matmul_kernel(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                        preferred_element_type=jnp.float32)


def matmul(x, y, bm=128, bn=128, bk=64, **schedule):
  """`schedule`: overrides of the lowering's choice (pipeline_depth,
  warp_specialize, num_consumers)."""
  m, k = x.shape
  n = y.shape[1]
  return pl.pallas_call(
      _matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // bm, n // bn, k // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      compiler_params=pl.mosaic_gpu.CompilerParams(**schedule),
      backend="mosaic_gpu")(x, y)


def _softmax_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def softmax(x):
  """A (64, C) block per row block: C > 256 moves as one tiled TMA copy."""
  spec = pl.BlockSpec((64, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(_softmax_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // 64,), in_specs=[spec],
                        out_specs=spec, backend="mosaic_gpu")(x)


def _attention_kernel(q_ref, k_ref, v_ref, o_ref):
  s = jnp.dot(q_ref[...], k_ref[...].T, preferred_element_type=jnp.float32)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  o = jnp.dot(p.astype(jnp.bfloat16), v_ref[...],
              preferred_element_type=jnp.float32)
  o_ref[...] = (o / jnp.sum(p, axis=-1, keepdims=True)).astype(o_ref.dtype)


def attention_tile(q, k, v, bq=64):
  """One KV tile per query block (no online softmax): a structural test of
  two wgmmas and a row softmax between them."""
  qs = pl.BlockSpec((bq, q.shape[1]), lambda i: (i, 0))
  kv = pl.BlockSpec(k.shape, lambda i: (0, 0))
  return pl.pallas_call(_attention_kernel,
                        jax.ShapeDtypeStruct(q.shape, q.dtype),
                        grid=(q.shape[0] // bq,), in_specs=[qs, kv, kv],
                        out_specs=qs, backend="mosaic_gpu")(q, k, v)


def _flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
  """Flash attention forward for one query block: online softmax over the
  KV blocks of the sequential grid dim; row statistics in scratch."""
  kv = pl.program_id(1)

  @pl.when(kv == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  s = jnp.dot(q_ref[...], k_ref[...].T,
              preferred_element_type=jnp.float32) * 0.125
  m_prev = m_ref[...]
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
  p = jnp.exp(s - m_new[:, None])
  alpha = jnp.exp(m_prev - m_new)
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1)
  acc_ref[...] = acc_ref[...] * alpha[:, None] + jnp.dot(
      p.astype(jnp.bfloat16), v_ref[...], preferred_element_type=jnp.float32)
  m_ref[...] = m_new

  @pl.when(kv == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = (acc_ref[...] / l_ref[...][:, None]).astype(o_ref.dtype)


def flash_attention(q, k, v, bq=64, bk=64, **schedule):
  n, d = q.shape
  return pl.pallas_call(
      _flash_kernel, jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(n // bq, k.shape[0] // bk),
      in_specs=[pl.BlockSpec((bq, d), lambda i, j: (i, 0)),
                pl.BlockSpec((bk, d), lambda i, j: (j, 0)),
                pl.BlockSpec((bk, d), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((bq, d), lambda i, j: (i, 0)),
      scratch_shapes=[pl.tpu.VMEM((bq,), jnp.float32),
                      pl.tpu.VMEM((bq,), jnp.float32),
                      pl.tpu.VMEM((bq, d), jnp.float32)],
      compiler_params=pl.mosaic_gpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"), **schedule),
      backend="mosaic_gpu")(q, k, v)


def _ref_attention(q, k, v, scale=1.0):
  s = q.astype(jnp.float32) @ k.astype(jnp.float32).T * scale
  return (jax.nn.softmax(s, axis=-1) @ v.astype(jnp.float32)).astype(q.dtype)


def _inputs(seed, *shapes_dtypes):
  keys = jax.random.split(jax.random.key(seed), len(shapes_dtypes))
  return [jax.random.normal(k, s, jnp.float32).astype(d)
          for k, (s, d) in zip(keys, shapes_dtypes)]


def _mm_ref(x, y):
  return jnp.dot(x, y, preferred_element_type=jnp.float32)


def _mm_inputs():
  return _inputs(1, ((512, 512), jnp.bfloat16), ((512, 512), jnp.bfloat16))


def _flash_ref(q, k, v):
  return _ref_attention(q, k, v, 0.125)


def _flash_inputs():
  return _inputs(4, ((512, 128), jnp.bfloat16), ((1024, 128), jnp.bfloat16),
                 ((1024, 128), jnp.bfloat16))


# The schedules the lowering can emit, on a GPU: name -> overrides
# (warp-specialized by default: a producer and two consumers; see
# docs/mosaic-gpu.md).
SCHEDULES = {
    "one_warpgroup": dict(warp_specialize=False),
    "one_slot": dict(pipeline_depth=1),
    "depth4_one_consumer": dict(pipeline_depth=4, num_consumers=1),
    "depth2_two_consumers": dict(pipeline_depth=2, num_consumers=2),
}

# name -> (kernel, jnp reference, inputs, atol)
CASES = {
    "add_f32": (add, lambda x, y: jnp.exp(x) + 2 * y,
                lambda: _inputs(0, ((512, 64), jnp.float32),
                                ((512, 64), jnp.float32)), 1e-5),
    "matmul_bf16": (matmul,
                    lambda x, y: jnp.dot(x, y,
                                         preferred_element_type=jnp.float32),
                    lambda: _inputs(1, ((512, 512), jnp.bfloat16),
                                    ((512, 512), jnp.bfloat16)), 1e-1),
    "softmax_bf16": (softmax,
                     lambda x: jax.nn.softmax(x.astype(jnp.float32),
                                              axis=-1).astype(x.dtype),
                     lambda: _inputs(2, ((512, 128), jnp.bfloat16)), 1e-2),
    "attention_tile_bf16": (attention_tile, _ref_attention,
                            lambda: _inputs(3, ((256, 128), jnp.bfloat16),
                                            ((128, 128), jnp.bfloat16),
                                            ((128, 128), jnp.bfloat16)), 5e-2),
    "flash_attention_bf16": (
        flash_attention,
        lambda q, k, v: _ref_attention(q, k, v, 0.125),
        lambda: _inputs(4, ((256, 128), jnp.bfloat16),
                        ((512, 128), jnp.bfloat16),
                        ((512, 128), jnp.bfloat16)), 5e-2),
    "wide_softmax_bf16": (softmax,
                          lambda x: jax.nn.softmax(x.astype(jnp.float32),
                                                   axis=-1).astype(x.dtype),
                          lambda: _inputs(5, ((256, 512), jnp.bfloat16)),
                          1e-2),
}
for _name, _params in SCHEDULES.items():
  CASES[f"matmul_bf16_{_name}"] = (
      functools.partial(matmul, **_params), _mm_ref, _mm_inputs, 1e-1)
  CASES[f"flash_attention_bf16_{_name}"] = (
      functools.partial(flash_attention, **_params), _flash_ref,
      _flash_inputs, 5e-2)
