"""The math of one flash attention tile, shared by the grid kernels
(`kernels.flash_attention`) and the in-kernel loops of the Triton kernels
(`kernels.flash_attention_loops`).

Scores are kept in base 2 (`sm_scale * log2(e)` folded into the scale,
`exp2` for `exp`), which saves a multiply per score on GPUs. A tile of
queries `qi` (rows `qi * bq ...`) and keys `kj` is masked where keys lie
past the end of a partial last block, by the causal triangle (query `i`
sees keys `0..i`) and by differing segment ids; `mask=None` is a tile that
needs none of it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

NEG = -1e30     # a finite -inf: exp(NEG - NEG) stays 1, never NaN
LOG2E = math.log2(math.e)


def dot_nt(a, b):   # a @ b.T
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def tile_mask(qi, kj, *, bq, bk, sq, sk, causal, qs=None, ks=None,
              mask_q=False, kv_major=False):
  """The bool mask of the tile at q block qi, kv block kj, or None: of shape
  (bq, bk), or (bk, bq) with `kv_major` (the dK/dV kernel's transposed
  tiles). `qs`, `ks`: the tile's query and key segment ids, or None."""
  mask = None

  def conj(a, b):
    return b if a is None else a & b

  shape, qdim = ((bk, bq), 1) if kv_major else ((bq, bk), 0)
  qpos = qi * bq + lax.broadcasted_iota(jnp.int32, shape, qdim)
  kpos = kj * bk + lax.broadcasted_iota(jnp.int32, shape, 1 - qdim)
  if sk % bk:
    mask = conj(mask, kpos < sk)
  if mask_q and sq % bq:
    mask = conj(mask, qpos < sq)
  if causal:
    mask = conj(mask, qpos >= kpos)
  if qs is not None:
    mask = conj(mask, ks[:, None] == qs[None, :] if kv_major
                else qs[:, None] == ks[None, :])
  return mask


def zero_rows(x, block, size: int, n: int):
  """`x` (rows of block `block` of `size` rows) with the rows past `n`, which
  hold poison, set to zero; `x` itself when blocks divide `n`."""
  if n % size == 0:
    return x
  ids = block * size + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(ids < n, x, jnp.zeros_like(x))


def probs(q, k, lse, mask, sm_scale, kv_major=False):
  """A tile's probabilities recomputed from the log-sum-exp, in base 2 as in
  the forward: (bq, bk), or (bk, bq) with `kv_major` (then `q`, `k` come
  swapped: the kv block first)."""
  s = dot_nt(q, k) * (sm_scale * LOG2E)
  lse2 = lse * LOG2E
  p = jnp.exp2(s - (lse2[None, :] if kv_major else lse2[:, None]))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  return p


def forward_update(q, k, v, m, l, acc, mask, sm_scale):
  """One kv tile folded into the running max `m`, sum `l` and unnormalized
  output `acc` (float32), rescaled by `exp2(m_old - m_new)` where the max
  grew: the new (m, l, acc)."""
  s = dot_nt(q, k) * (sm_scale * LOG2E)     # scores in base 2
  if mask is not None:
    s = jnp.where(mask, s, NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  p = jnp.exp2(s - m_new[:, None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  alpha = jnp.exp2(m - m_new)
  l = l * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  return m_new, l, acc


def forward_result(m, l, acc):
  """(out, lse) of rows whose running statistics are final: rows that saw
  no key output 0; the log-sum-exp back in base e."""
  l = jnp.where(l == 0.0, 1.0, l)
  return acc / l[:, None], m / LOG2E + jnp.log(l)


def dkdv_update(q, k, v, do, lse, delta, mask, sm_scale):
  """The (dK, dV) of one tile, on transposed tiles (kv rows x q rows) so the
  kv block is the M side of every dot: sT = k q^T, dV = pT do, dpT = v
  do^T, dK = dsT q. `mask` is kv-major."""
  p_t = probs(k, q, lse, mask, sm_scale, kv_major=True)
  dv = dot(p_t.astype(do.dtype), do)
  ds_t = p_t * (dot_nt(v, do) - delta[None, :])
  return dot(ds_t.astype(q.dtype), q) * sm_scale, dv


def dq_update(q, k, v, do, lse, delta, mask, sm_scale):
  """The dQ of one tile."""
  p = probs(q, k, lse, mask, sm_scale)
  ds = p * (dot_nt(do, v) - delta[:, None])
  return dot(ds.astype(k.dtype), k) * sm_scale
