"""Decode attention: one query step of every sequence against its kv cache.

`q`: `(batch, heads, head_dim)`; caches `(batch, max_len, kv_heads,
head_dim)`; `lengths`: `(batch,)` valid positions per sequence. Grid
`(batch, kv_heads, kv_blocks)`: a program takes all the q heads that share a
kv head (GQA) as one `(group, head_dim)` block, so each cache block is read
once per kv head, and walks the cache blocks with an online softmax.

`lengths` is a scalar-prefetch operand (`dsl.tpu.PrefetchScalarGridSpec`): the
kernel masks positions past a sequence's length, skips blocks entirely past
it, and the cache index maps clamp the block index to the last valid block,
so a backend that copies blocks (TPU DMAs) re-uses the block it already has
instead of fetching blocks that would be masked anyway.

On the Mosaic TPU backends the caches are transposed to head-major
`(batch, kv_heads, max_len, head_dim)` around the call: a TPU block may not
squeeze its second-minor dim (the kv heads of the public layout).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import dsl as pl
from dsl import tpu as pltpu
from kernels import blocking

NEG = -1e30


def reference(q, k_cache, v_cache, lengths, *, sm_scale=None):
  """Plain-jnp single-step attention over the first `lengths[b]` positions."""
  b, h, d = q.shape
  s_max, hkv = k_cache.shape[1], k_cache.shape[2]
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  g = h // hkv
  q4 = q.astype(jnp.float32).reshape(b, hkv, g, d)
  s = jnp.einsum("bhgd,bshd->bhgs", q4, k_cache.astype(jnp.float32)) * sm_scale
  mask = (jnp.arange(s_max)[None, :] < lengths[:, None])[:, None, None, :]
  s = jnp.where(mask, s, NEG)
  p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  o = jnp.einsum("bhgs,bshd->bhgd", p, v_cache.astype(jnp.float32))
  return o.reshape(b, h, d).astype(q.dtype)


# ---------------------------------------------------------------- kernel core

def init_scratch(m_sc, l_sc, acc_sc):
  m_sc[...] = jnp.full_like(m_sc, NEG)
  l_sc[...] = jnp.zeros_like(l_sc)
  acc_sc[...] = jnp.zeros_like(acc_sc)


def attend_tile(q, k, v, start, length, sm_scale, m_sc, l_sc, acc_sc):
  """Folds keys/values `k`, `v` (n, d) at positions start.. into the state."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                      preferred_element_type=jnp.float32) * sm_scale
  pos = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  mask = pos < length
  s = jnp.where(mask, s, NEG)
  m_prev = m_sc[...]
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
  alpha = jnp.exp(m_prev - m_new)
  l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1)
  # Values past the length (past the cache, in a partial last block) are
  # garbage, NaN maybe: a zero weight does not cancel them in the dot.
  rows = start + lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
  v = jnp.where(rows < length, v, jnp.zeros_like(v))
  acc_sc[...] = acc_sc[...] * alpha[:, None] + lax.dot_general(
      p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32)
  m_sc[...] = m_new


def finish(o_ref, l_sc, acc_sc):
  l = l_sc[...]
  l = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc_sc[...] / l[:, None]).astype(o_ref.dtype)


def last_block(length, block: int):
  """Index of the last block holding a valid position (0 when empty)."""
  return jnp.maximum(pl.cdiv(length, block) - 1, 0)


# ---------------------------------------------------------------- decode

def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *,
                   sm_scale, bk, nk):
  b, j = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]

  @pl.when(j == 0)
  def _():
    init_scratch(m_sc, l_sc, acc_sc)

  @pl.when(j * bk < length)
  def _():
    attend_tile(q_ref[...], k_ref[...], v_ref[...], j * bk, length, sm_scale,
                m_sc, l_sc, acc_sc)

  @pl.when(j == nk - 1)
  def _():
    finish(o_ref, l_sc, acc_sc)


def decode_block(s_max: int, backend: str, block_k=None) -> int:
  if block_k is not None:
    return min(block_k, s_max)
  return blocking.block_for(s_max, backend, interpret=512, triton=128,
                            mosaic=512, mosaic_multiple=128)


def check_decode_shapes(q, k_cache, v_cache, lengths):
  if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
    raise ValueError(f"decode_attention: expected q (batch, heads, head_dim) "
                     f"and caches (batch, max_len, kv_heads, head_dim); got "
                     f"{q.shape}, {k_cache.shape}, {v_cache.shape}")
  b, h, d = q.shape
  if k_cache.shape[0] != b or k_cache.shape[3] != d or h % k_cache.shape[2]:
    raise ValueError(f"decode_attention: q {q.shape} does not fit caches "
                     f"{k_cache.shape}")
  if lengths.shape != (b,):
    raise ValueError(f"decode_attention: lengths {lengths.shape} must be "
                     f"({b},)")


@blocking.per_platform("decode_attention")
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None,
                     backend=None, block_k=None):
  """Attention of one query per sequence over its first `lengths[b]` cached
  keys/values. `q`: (batch, heads, head_dim); caches: (batch, max_len,
  kv_heads, head_dim) with heads % kv_heads == 0. Returns (batch, heads,
  head_dim)."""
  q, k_cache, v_cache = map(jnp.asarray, (q, k_cache, v_cache))
  lengths = jnp.asarray(lengths, jnp.int32)
  check_decode_shapes(q, k_cache, v_cache, lengths)
  b, h, d = q.shape
  s_max, hkv = k_cache.shape[1], k_cache.shape[2]
  g = h // hkv
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
  resolved = blocking.resolve_backend(backend)
  bk = decode_block(s_max, resolved, block_k)
  nk = pl.cdiv(s_max, bk)
  q4 = q.reshape(b, hkv, g, d)
  q_spec = pl.BlockSpec((None, None, g, d),
                        lambda b_, h_, j, lens: (b_, h_, 0, 0))

  def kv_block(b_, j, lens):
    return jnp.minimum(j, last_block(lens[b_], bk))

  if blocking.is_tpu(resolved):
    # TPU blocks may not squeeze the second-minor dim: head-major caches
    # (batch, kv_heads, max_len, head_dim), blocks (bk, head_dim).
    k_cache, v_cache = (jnp.swapaxes(c, 1, 2) for c in (k_cache, v_cache))
    kv_spec = pl.BlockSpec(
        (None, None, bk, d),
        lambda b_, h_, j, lens: (b_, h_, kv_block(b_, j, lens), 0))
  else:
    kv_spec = pl.BlockSpec(
        (None, bk, None, d),
        lambda b_, h_, j, lens: (b_, kv_block(b_, j, lens), h_, 0))
  out = pl.pallas_call(
      functools.partial(_decode_kernel, sm_scale=sm_scale, bk=bk, nk=nk),
      jax.ShapeDtypeStruct(q4.shape, q.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, hkv, nk),
          in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((g,), jnp.float32),
                          pltpu.VMEM((g,), jnp.float32),
                          pltpu.VMEM((g, d), jnp.float32)]),
      backend=backend, name="decode_attention")(lengths, q4, k_cache, v_cache)
  return out.reshape(b, h, d)
