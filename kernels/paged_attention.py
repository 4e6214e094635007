"""Paged attention: decode attention over a kv cache stored in pages.

The cache is a pool of pages `(kv_heads, num_pages, page_size, head_dim)`;
sequence `b` owns pages `page_indices[b, 0..]` in order and has `lengths[b]`
valid positions. Grid `(batch, kv_heads, page_blocks)`; both `lengths` and
`page_indices` are scalar-prefetch operands, so the cache BlockSpecs' index
maps look the page up in the table: block `(h, page_indices[b, p], 0, 0)`.
A compute block of `pages_per_compute_block` pages passes the cache once per
page of the block, each with its own index map; the kernel folds the pages
into its online softmax one by one, or (on the CPU interpreter, where wide
tiles are cheaper) concatenates them into one tile. Pages past a sequence's
length are clamped to its last valid page (no new copy) and masked.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import dsl as pl
from dsl import tpu as pltpu
from kernels import blocking
from kernels.decode_attention import (attend_tile, finish, init_scratch,
                                      last_block)
from kernels.decode_attention import reference as _decode_reference


def reference(q, k_pages, v_pages, lengths, page_indices, *, sm_scale=None):
  """Gathers each sequence's pages into a contiguous cache; decode attention."""
  hkv, _, page_size, d = k_pages.shape
  b, pages_per_seq = page_indices.shape

  def gather(pages):
    g = pages[:, page_indices]            # (hkv, b, pages_per_seq, ps, d)
    g = g.reshape(hkv, b, pages_per_seq * page_size, d)
    return jnp.transpose(g, (1, 2, 0, 3))  # (b, s, hkv, d)

  return _decode_reference(q, gather(k_pages), gather(v_pages), lengths,
                           sm_scale=sm_scale)


def _paged_kernel(len_ref, pt_ref, q_ref, *refs, sm_scale, page_size, npb,
                  n_blocks, concat):
  k_refs, v_refs = refs[:npb], refs[npb:2 * npb]
  o_ref, m_sc, l_sc, acc_sc = refs[2 * npb:]
  b, j = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]
  span = npb * page_size
  del pt_ref

  @pl.when(j == 0)
  def _():
    init_scratch(m_sc, l_sc, acc_sc)

  @pl.when(j * span < length)
  def _():
    q = q_ref[...]
    if concat:     # one (group, npb * page_size) tile
      k = jnp.concatenate([r[...] for r in k_refs], axis=0)
      v = jnp.concatenate([r[...] for r in v_refs], axis=0)
      attend_tile(q, k, v, j * span, length, sm_scale, m_sc, l_sc, acc_sc)
    else:          # one online-softmax update per page
      for t in range(npb):
        attend_tile(q, k_refs[t][...], v_refs[t][...],
                    j * span + t * page_size, length, sm_scale, m_sc, l_sc,
                    acc_sc)

  @pl.when(j == n_blocks - 1)
  def _():
    finish(o_ref, l_sc, acc_sc)


def _pages_per_block(page_size: int, pages_per_seq: int, backend: str,
                     requested):
  if requested is not None:
    return max(1, min(requested, pages_per_seq))
  if blocking.is_triton(backend):
    target = 128
  elif blocking.is_mosaic(backend):
    target = 512
  else:
    target = 1024      # interpret: few loop steps
  npb = max(1, min(pages_per_seq, target // page_size, 16))
  while pages_per_seq % npb:   # prefer blocks that tile the table exactly
    npb -= 1
  return npb


@blocking.per_platform("paged_attention")
def paged_attention(q, k_pages, v_pages, lengths, page_indices, *,
                    sm_scale=None, pages_per_compute_block=None, backend=None,
                    concat_pages=None):
  """Decode attention with a paged kv cache.

  `q`: (batch, heads, head_dim); `k_pages`, `v_pages`: (kv_heads, num_pages,
  page_size, head_dim); `lengths`: (batch,) int; `page_indices`: (batch,
  pages_per_sequence) int, the pages of each sequence in order. Entries of
  the table past a sequence's length are never read. Returns (batch, heads,
  head_dim). `pages_per_compute_block` pages are handled per grid step;
  `concat_pages` chooses whether they form one tile (default on the CPU
  interpreter) or are folded in one by one.
  """
  q, k_pages, v_pages = map(jnp.asarray, (q, k_pages, v_pages))
  lengths = jnp.asarray(lengths, jnp.int32)
  page_indices = jnp.asarray(page_indices, jnp.int32)
  b, h, d = q.shape
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or (
      k_pages.shape[3] != d) or h % k_pages.shape[0]:
    raise ValueError(f"paged_attention: q {q.shape} does not fit pages "
                     f"{k_pages.shape} / {v_pages.shape}")
  if page_indices.ndim != 2 or page_indices.shape[0] != b or (
      lengths.shape != (b,)):
    raise ValueError(f"paged_attention: page_indices {page_indices.shape} "
                     f"and lengths {lengths.shape} must be ({b}, pages) and "
                     f"({b},)")
  hkv, num_pages, page_size, _ = k_pages.shape
  pages_per_seq = page_indices.shape[1]
  g = h // hkv
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
  be = blocking.resolve_backend(backend)
  npb = _pages_per_block(page_size, pages_per_seq, be, pages_per_compute_block)
  n_blocks = pl.cdiv(pages_per_seq, npb)
  # The CPU interpreter prefers one wide tile; compiled backends get one
  # update per page (no concatenation in registers / VMEM).
  concat = npb > 1 and blocking.is_jax(be) if concat_pages is None else bool(
      concat_pages)

  def page_map(t):
    def index_map(b_, h_, j, lens, table):
      p = jnp.minimum(j * npb + t, last_block(lens[b_], page_size))
      p = jnp.minimum(p, pages_per_seq - 1)
      page = jnp.clip(table[b_, p], 0, num_pages - 1)
      return h_, page, 0, 0
    return index_map

  q4 = q.reshape(b, hkv, g, d)
  q_spec = pl.BlockSpec((None, None, g, d),
                        lambda b_, h_, j, lens, table: (b_, h_, 0, 0))
  page_specs = [pl.BlockSpec((None, None, page_size, d), page_map(t))
                for t in range(npb)]
  out = pl.pallas_call(
      functools.partial(_paged_kernel, sm_scale=sm_scale, page_size=page_size,
                        npb=npb, n_blocks=n_blocks, concat=concat),
      jax.ShapeDtypeStruct(q4.shape, q.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, hkv, n_blocks),
          in_specs=[q_spec, *page_specs, *page_specs], out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((g,), jnp.float32),
                          pltpu.VMEM((g,), jnp.float32),
                          pltpu.VMEM((g, d), jnp.float32)]),
      backend=backend, name="paged_attention")(
          lengths, page_indices, q4, *([k_pages] * npb), *([v_pages] * npb))
  return out.reshape(b, h, d)
