"""Flash attention on Triton: each program walks its blocks in loops whose
bounds come from its program id.

A grid of `(batch, heads, q_blocks)` (dQ and the forward) or `(batch,
kv_heads, kv_blocks)` (dK/dV) keeps one block of its own rows on chip and
walks the other side's blocks with `lax.fori_loop`, reading them from
whole-sequence blocks with `pl.ds` windows. Where the block a program needs
depends on its position (causal attention), the loop bounds say so:

- blocks entirely above the causal diagonal are never loaded or computed
  (causal attention does about half the work of non-causal);
- blocks entirely below it, and whole (no padding rows), run in a loop
  without masks;
- only the blocks the diagonal crosses, partial last blocks, and every block
  of a kernel with segment ids run in a masked loop.

A bound that depends on the program id is a run-time value: `fori_loop`
makes a `while` of it, which the Triton lowering emits as `for i in
tl.range(lo, hi)`, a loop Triton pipelines. The tile math is
`kernels.attention_tiles`, shared with the grid kernels that the other
backends run (`kernels.flash_attention`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import dsl as pl
from kernels.attention_tiles import (NEG, dkdv_update, dq_update,
                                     forward_result, forward_update,
                                     tile_mask, zero_rows)


def _loop(lo, hi, body, carry):
  """`fori_loop(lo, hi, body, carry)`, or `carry` when the range is empty
  at trace time."""
  if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def _div(a, b: int):
  """`a // b` for `a >= 0`: truncating division on traced values (which the
  range analysis bounds exactly; jnp's `//` rounds toward minus infinity
  through a select that widens the interval below 0)."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def kv_bounds(qi, *, bq, bk, sq, sk, causal, has_seg):
  """(full, needed) for q block `qi`: kv blocks `[0, full)` need no mask,
  `[full, needed)` need one, later blocks are not needed (causal)."""
  del sq
  nk = pl.cdiv(sk, bk)
  if causal:
    # key block j is needed while j * bk <= the block's last row, and
    # unmasked while its last key (j + 1) * bk - 1 <= the block's first row.
    needed = jnp.minimum(nk, _div(qi * bq + bq + bk - 1, bk))
    full = jnp.minimum(_div(qi * bq + 1, bk), sk // bk)
  else:
    needed, full = nk, sk // bk
  return (0 if has_seg else full), needed


def q_bounds(kj, *, bq, bk, sq, sk, causal, has_seg):
  """((lo, start), (start, tail), (tail, nq)) for kv block `kj`: masked q
  blocks from `lo` (the diagonal crosses them), unmasked whole ones from
  `start`, and a masked partial last q block from `tail`. Causal: q blocks
  before `lo` see none of the block's keys."""
  nq, whole = pl.cdiv(sq, bq), sq // bq
  if causal:
    lo = _div(kj * bk, bq)                      # the first q row >= kj * bk
    start = jnp.minimum(_div(kj * bk + bk - 1 + bq - 1, bq), nq)
  else:
    lo, start = 0, 0
  if has_seg:
    start = nq
  elif sk % bk:                                 # a partial kv block: masked
    start = jnp.where(kj == pl.cdiv(sk, bk) - 1, nq, start)
  if whole == nq:                               # no partial q block
    return (lo, start), (start, nq), (nq, nq)
  tail = jnp.maximum(start, whole) if not isinstance(start, int) else max(
      start, whole)
  return (lo, start), (start, tail), (tail, nq)


# ---------------------------------------------------------------- forward

def _fwd_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk):
  q_ref, k_ref, v_ref = refs[:3]
  qs_ref, ks_ref = refs[3:5] if has_seg else (None, None)
  o_ref, lse_ref = refs[-2:]
  qi = pl.program_id(2)
  q = q_ref[...]
  qs = qs_ref[...] if has_seg else None

  def step(masked):
    def body(kj, carry):
      window = pl.ds(pl.multiple_of(kj * bk, bk), bk)
      k, v = k_ref[window, :], v_ref[window, :]
      mask = None
      if masked:
        v = zero_rows(v, kj, bk, sk)
        ks = ks_ref[window] if has_seg else None
        mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                         qs=qs, ks=ks)
      return forward_update(q, k, v, *carry, mask, sm_scale)
    return body

  full, needed = kv_bounds(qi, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                           has_seg=has_seg)
  carry = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, q.shape[-1]), jnp.float32))
  carry = _loop(0, full, step(False), carry)
  carry = _loop(full, needed, step(True), carry)
  o, lse = forward_result(*carry)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _q_rows_spec(bq, d):
  return pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0))


def _seg_specs(q_rows, kv_rows, q_index, kv_index):
  return [pl.BlockSpec((None, q_rows), q_index),
          pl.BlockSpec((None, kv_rows), kv_index)]


def forward(q, k, v, q_seg, kv_seg, *, causal, sm_scale, backend, bq, bk,
            compiler_params):
  """(out, lse): grid (batch, heads, q_blocks), the keys walked in loops."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  has_seg = q_seg is not None
  kv_spec = pl.BlockSpec((None, sk, None, d),
                         lambda b_, h_, i: (b_, 0, h_ // g, 0))
  segs = _seg_specs(bq, sk, lambda b_, h_, i: (b_, i),
                    lambda b_, h_, i: (b_, 0)) if has_seg else []
  kernel = functools.partial(_fwd_kernel, sm_scale=sm_scale, causal=causal,
                             has_seg=has_seg, bq=bq, bk=bk, sq=sq, sk=sk)
  return pl.pallas_call(
      kernel,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
      grid=(b, h, pl.cdiv(sq, bq)),
      in_specs=[_q_rows_spec(bq, d), kv_spec, kv_spec, *segs],
      out_specs=(_q_rows_spec(bq, d),
                 pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))),
      compiler_params=compiler_params, backend=backend,
      name="flash_attention_fwd")(q, k, v, *((q_seg, kv_seg) if has_seg
                                             else ()))


# ---------------------------------------------------------------- backward

def _dkdv_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk, g):
  """Each program keeps one kv block and walks the q blocks of every q head
  that shares its kv head (GQA: the group's sum happens in the
  accumulators)."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qs_ref, ks_ref = refs[6:8] if has_seg else (None, None)
  dk_ref, dv_ref = refs[-2:]
  kj = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  ks = ks_ref[...] if has_seg else None

  def step(hg, masked):
    def body(qi, carry):
      window = pl.ds(pl.multiple_of(qi * bq, bq), bq)
      q, do = q_ref[window, hg, :], do_ref[window, hg, :]
      lse, delta = lse_ref[hg, window], delta_ref[hg, window]
      mask = None
      if masked:
        q, do = zero_rows(q, qi, bq, sq), zero_rows(do, qi, bq, sq)
        delta = zero_rows(delta, qi, bq, sq)
        qs = qs_ref[window] if has_seg else None
        mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                         qs=qs, ks=ks, mask_q=True, kv_major=True)
      dk, dv = dkdv_update(q, k, v, do, lse, delta, mask, sm_scale)
      return carry[0] + dk, carry[1] + dv
    return body

  below, whole, tail = q_bounds(kj, bq=bq, bk=bk, sq=sq, sk=sk,
                                causal=causal, has_seg=has_seg)

  def head(hg, carry):
    carry = _loop(*below, step(hg, True), carry)
    carry = _loop(*whole, step(hg, False), carry)
    return _loop(*tail, step(hg, True), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = head(0, (zeros, zeros)) if g == 1 else lax.fori_loop(
      0, g, head, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qs_ref, ks_ref = refs[6:8] if has_seg else (None, None)
  dq_ref = refs[-1]
  qi = pl.program_id(2)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qs = qs_ref[...] if has_seg else None

  def step(masked):
    def body(kj, dq):
      window = pl.ds(pl.multiple_of(kj * bk, bk), bk)
      k, v = k_ref[window, :], v_ref[window, :]
      mask = None
      if masked:
        k, v = zero_rows(k, kj, bk, sk), zero_rows(v, kj, bk, sk)
        ks = ks_ref[window] if has_seg else None
        mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                         qs=qs, ks=ks)
      return dq + dq_update(q, k, v, do, lse, delta, mask, sm_scale)
    return body

  full, needed = kv_bounds(qi, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                           has_seg=has_seg)
  dq = _loop(0, full, step(False), jnp.zeros(q.shape, jnp.float32))
  dq = _loop(full, needed, step(True), dq)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward_dkdv(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal,
                  sm_scale, backend, bq, bk, compiler_params):
  """(dk, dv): grid (batch, kv_heads, kv_blocks), the q blocks in loops."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  has_seg = q_seg is not None
  q_spec = pl.BlockSpec((None, sq, g, d), lambda b_, hk, j: (b_, 0, hk, 0))
  kv_spec = pl.BlockSpec((None, bk, None, d), lambda b_, hk, j: (b_, j, hk, 0))
  row_spec = pl.BlockSpec((None, g, sq), lambda b_, hk, j: (b_, hk, 0))
  segs = _seg_specs(sq, bk, lambda b_, hk, j: (b_, 0),
                    lambda b_, hk, j: (b_, j)) if has_seg else []
  kernel = functools.partial(_dkdv_kernel, sm_scale=sm_scale, causal=causal,
                             has_seg=has_seg, bq=bq, bk=bk, sq=sq, sk=sk, g=g)
  return pl.pallas_call(
      kernel,
      (jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(b, hkv, pl.cdiv(sk, bk)),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *segs],
      out_specs=(kv_spec, kv_spec), compiler_params=compiler_params,
      backend=backend, name="flash_attention_bwd_dkdv")(
          q, k, v, do, lse, delta, *((q_seg, kv_seg) if has_seg else ()))


def backward_dq(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal, sm_scale,
                backend, bq, bk, compiler_params):
  """dq: grid (batch, heads, q_blocks), the keys walked in loops."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  has_seg = q_seg is not None
  kv_spec = pl.BlockSpec((None, sk, None, d),
                         lambda b_, h_, i: (b_, 0, h_ // g, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))
  segs = _seg_specs(bq, sk, lambda b_, h_, i: (b_, i),
                    lambda b_, h_, i: (b_, 0)) if has_seg else []
  kernel = functools.partial(_dq_kernel, sm_scale=sm_scale, causal=causal,
                             has_seg=has_seg, bq=bq, bk=bk, sq=sq, sk=sk)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, h, pl.cdiv(sq, bq)),
      in_specs=[_q_rows_spec(bq, d), kv_spec, kv_spec, _q_rows_spec(bq, d),
                row_spec, row_spec, *segs],
      out_specs=_q_rows_spec(bq, d), compiler_params=compiler_params,
      backend=backend, name="flash_attention_bwd_dq")(
          q, k, v, do, lse, delta, *((q_seg, kv_seg) if has_seg else ()))
