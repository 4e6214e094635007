"""Flash attention on `(batch, seq, heads, head_dim)`, forward and backward.

Forward, grid `(batch, heads, q_blocks, kv_blocks)`: the first three dims are
parallel, the last walks the keys in order. Each step scores one `(bq, bk)`
tile, masks it (keys past the end of a partial last block, the causal
triangle, differing segment ids), and folds it into a running max `m`, a
running sum `l` and an unnormalized output `acc` (float32 scratch), rescaling
them by `exp(m_old - m_new)` when the max grows. Scores are kept in base 2
(`sm_scale * log2(e)` folded into the scale, `exp2` for `exp`), which saves a
multiply per score on GPUs. The last step writes
`acc / l` and the log-sum-exp `m + log(l)` that the backward pass uses.

Backward (FlashAttention-2 style), three kernels:

- `delta = rowsum(o * do)`, parallel over every block;
- dK/dV, grid `(batch, kv_heads, kv_blocks, group * q_blocks)`: each kv block
  walks every q block of every q head that shares its kv head (GQA/MQA), so
  the group's sum happens in the accumulator, not in a later reduction;
- dQ, grid `(batch, heads, q_blocks, kv_blocks)`, walking the keys.

Both recompute the probabilities from `q`, `k` and the saved log-sum-exp.
Causal masking is aligned at the top left: query `i` sees keys `0..i`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import dsl as pl
from dsl import tpu as pltpu
from kernels import blocking, flash_attention_loops
from kernels.attention_tiles import (NEG, dkdv_update, dq_update,
                                     forward_result, forward_update,
                                     tile_mask, zero_rows)



# ---------------------------------------------------------------- reference

def _split_segments(segment_ids, sq, sk):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    if sq != sk:
      raise ValueError("flash_attention: one segment_ids array needs equal q "
                       "and kv lengths; pass (q_segment_ids, kv_segment_ids)")
    q_seg = kv_seg = segment_ids
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def reference(q, k, v, *, causal=False, segment_ids=None, sm_scale=None):
  """Plain-jnp attention with the same masking, in float32."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  g = h // hkv
  k32 = jnp.repeat(k.astype(jnp.float32), g, axis=2)
  v32 = jnp.repeat(v.astype(jnp.float32), g, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k32) * sm_scale
  mask = jnp.ones((b, 1, sq, sk), bool)
  if causal:
    mask &= (jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :])[None, None]
  q_seg, kv_seg = _split_segments(segment_ids, sq, sk)
  if q_seg is not None:
    mask &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  s = jnp.where(mask, s, NEG)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = jnp.where(mask, p, 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v32).astype(q.dtype)


# ---------------------------------------------------------------- blocks

# Triton configs (block_q, block_k, num_warps, num_stages) for head_dim > 64,
# where the shipped GPU defaults (dsl/tools/data/gpu_configs.json, entries
# kernels.flash_attention[.dkdv|.dq]) have none for the device. The
# forward's was measured on an H100 with `python -m
# benchmarks.gpu_kernel_sweep`. In the backward each kernel keeps one block
# and walks the other: dK/dV keeps 128 kv rows (the M side of all its dots,
# two warpgroups of Hopper wgmma; 32 rows would fall back to mma.sync) and
# steps 32 q rows; dQ keeps 128 q rows and steps 32 kv rows. Both compile
# for sm_90 without register spills at 8 warps (240 and 161 registers).
TRITON_CONFIGS = {
    "fwd": (128, 128, 8, 2),
    "dkdv": (32, 128, 8, 3),
    "dq": (128, 32, 8, 3),
}
SMALL_CONFIG = (64, 64, 4, 3)    # head_dim <= 64, or smaller given tiles
# Shared memory one Hopper program may use (227 KiB): the pipelined tiles of
# a config must fit, or the kernel does not launch.
SHARED_BYTES = 227 * 1024


def _shared_bytes(kernel, bq, bk, d, itemsize, stages) -> int:
  """The shared memory of a kernel's pipelined tiles: the blocks it keeps
  once, the blocks it steps through once per stage (what Triton allocates
  for these kernels, to the byte for the forward)."""
  kept, stepped = {"fwd": (bq, 2 * bk), "dq": (2 * bq, 2 * bk),
                   "dkdv": (2 * bk, 2 * bq)}[kernel]
  return itemsize * d * (kept + stages * stepped)


def _triton_config(kernel, d, itemsize=2):
  """(block_q, block_k, num_warps, num_stages): the table's, with the
  stepped block (then the kept one) halved until the tiles fit in shared
  memory (float32 at head_dim 128: the forward's 128 x 128 tiles with 2
  stages need 320 KiB, 128 x 64 ones 192 KiB)."""
  bq, bk, warps, stages = SMALL_CONFIG if d <= 64 else TRITON_CONFIGS[kernel]
  while _shared_bytes(kernel, bq, bk, d, itemsize, stages) > SHARED_BYTES:
    stepped, kept = (bq, bk) if kernel == "dkdv" else (bk, bq)
    if max(stepped, kept) <= 16:
      break
    if stepped > 16:
      stepped //= 2
    else:
      kept //= 2
    bq, bk = (stepped, kept) if kernel == "dkdv" else (kept, stepped)
  return bq, bk, warps, stages


def _triton_params(kernel, backend, d, bq, bk, tuned=None, itemsize=2):
  """Launch parameters: the shipped GPU default's (`tuned`, from
  `blocking.gpu_config`) when it has them, else the table above."""
  if tuned and "num_warps" in tuned:
    return blocking.triton_params(backend, num_warps=tuned["num_warps"],
                                  num_stages=tuned.get("num_stages"))
  cfg = _triton_config(kernel, d, itemsize)
  if bq * bk < cfg[0] * cfg[1]:
    cfg = SMALL_CONFIG
  stages = cfg[3]
  while stages > 1 and _shared_bytes(kernel, bq, bk, d, itemsize,
                                     stages) > SHARED_BYTES:
    stages -= 1     # blocks the caller chose: fewer stages, to fit
  return blocking.triton_params(backend, num_warps=cfg[2], num_stages=stages)


def attention_blocks(sq: int, sk: int, d: int, backend: str, block_q=None,
                     block_k=None, kernel: str = "fwd", itemsize: int = 2):
  """(block_q, block_k) of `kernel` ("fwd", "dkdv" or "dq") for operands of
  `itemsize` bytes."""
  backward = kernel != "fwd"
  if blocking.is_triton(backend):
    tq, tk = _triton_config(kernel, d, itemsize)[:2]
    if blocking.runs_on_host(backend):
      # A quarter of the GPU's tiles, so each backward kernel's own shape
      # runs through Triton's interpreter too.
      tq, tk = (t // 4 for t in TRITON_CONFIGS[kernel][:2])
  elif blocking.is_mosaic_gpu(backend):
    # 64 query rows per consumer warpgroup (the wgmma layout's rows), two
    # consumers per CTA sharing 64-key K/V blocks (their f32 accumulators
    # and q copies share the CTA's shared memory with the K/V ring).
    return block_q or blocking.gpu_rows(sq, 64), \
        block_k or blocking.gpu_rows(sk, 64)
  elif blocking.is_mosaic(backend):
    tq, tk = 512, 512
  else:
    # interpret: q blocks are parallel (vectorized), kv blocks are loop
    # steps; (bq, 256) tiles keep each step's scores cache-sized. The
    # backward kernels measured faster with whole 1024 x 1024 tiles (XLA
    # re-lays out vectorized narrow tiles of the dK/dV kernel).
    tq, tk = (1024, 1024) if backward else (1024, 256)
  # On a TPU a q block is also the lane dim of the lse / delta row blocks:
  # a multiple of 128 (or the whole sequence).
  bq = block_q or blocking.block_for(
      sq, backend, interpret=tq, triton=tq, mosaic=tq,
      mosaic_multiple=128 if blocking.is_tpu(backend) else 8)
  bk = block_k or blocking.block_for(sk, backend, interpret=tk, triton=tk,
                                     mosaic=tk, mosaic_multiple=128)
  return min(bq, sq), min(bk, sk)


def _tile_needed(qi, kj, *, bq, bk, causal):
  """False for tiles entirely above the causal diagonal."""
  if not causal:
    return True
  return kj * bk <= qi * bq + bq - 1


def _run_if(cond, fn):
  if cond is True:
    fn()
  else:
    pl.when(cond)(fn)


# ---------------------------------------------------------------- layouts
#
# The public layout is (batch, seq, heads, head_dim): a block takes rows of
# one head, squeezing the heads dim, the second-minor one. A TPU block may
# not squeeze its last two dims (they are windows of (8, 128) tiles), so on
# the Mosaic TPU backends ("head-major", `hm`) the wrappers transpose the
# operands to (batch, heads, seq, head_dim), and lay the per-row vectors
# (lse, delta) out as (batch, heads, 1, seq) and segment ids as
# (batch, 1, seq). Kernels see the same blocks either way, but for the row
# vectors' leading 1 (`_rows` / `_set_rows`).

def _head_major(backend) -> bool:
  return blocking.is_tpu(blocking.resolve_backend(backend))


def _rows(ref):
  """A row-vector block as (rows,): (1, rows) in the head-major layout."""
  x = ref[...]
  return x.reshape(x.shape[-1]) if x.ndim > 1 else x


def _set_rows(ref, x):
  ref[...] = x.reshape(ref.shape)


def _segments(qs_ref, ks_ref) -> dict:
  """`tile_mask`'s segment ids of a tile, from its segment-id blocks."""
  if qs_ref is None:
    return {}
  return dict(qs=_rows(qs_ref), ks=_rows(ks_ref))


def _to_layout(hm, *xs):
  """(batch, seq, heads, dim) arrays in the kernels' layout, or back."""
  return tuple(jnp.swapaxes(x, 1, 2) if hm else x for x in xs)


def _seq_spec(hm, rows, d, index):
  """Blocks of `rows` rows of one head; `index(*grid) -> (b, h, i)`."""
  def index_map(*ids):
    b_, h_, i = index(*ids)
    return (b_, h_, i, 0) if hm else (b_, i, h_, 0)
  shape = (None, None, rows, d) if hm else (None, rows, None, d)
  return pl.BlockSpec(shape, index_map)


def _row_shape(hm, b, h, s):
  return (b, h, 1, s) if hm else (b, h, s)


def _row_spec(hm, rows, index):
  """Blocks of a (b, h, s) row vector (lse, delta); `index -> (b, h, i)`."""
  def index_map(*ids):
    b_, h_, i = index(*ids)
    return (b_, h_, 0, i) if hm else (b_, h_, i)
  shape = (None, None, 1, rows) if hm else (None, None, rows)
  return pl.BlockSpec(shape, index_map)


def _seg_args(hm, q_seg, kv_seg, q_index, kv_index, bq, bk):
  """Segment-id operands and specs; `q_index`/`kv_index(*grid) -> (b, i)`."""
  if q_seg is None:
    return [], []

  def spec(rows, index):
    def index_map(*ids):
      b_, i = index(*ids)
      return (b_, 0, i) if hm else (b_, i)
    return pl.BlockSpec((None, 1, rows) if hm else (None, rows), index_map)

  segs = [x.reshape(x.shape[0], 1, x.shape[1]) if hm else x
          for x in (q_seg, kv_seg)]
  return segs, [spec(bq, q_index), spec(bk, kv_index)]


# ---------------------------------------------------------------- forward

def _fwd_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk, nk,
                copy_q):
  q_ref, k_ref, v_ref = refs[:3]
  qs_ref, ks_ref = refs[3:5] if has_seg else (None, None)
  o_ref, lse_ref, m_sc, l_sc, acc_sc, q_sc = (
      refs[-6:] if copy_q else (*refs[-5:], None))
  qi, kj = pl.program_id(2), pl.program_id(3)

  @pl.when(kj == 0)
  def _():
    m_sc[...] = jnp.full_like(m_sc, NEG)
    l_sc[...] = jnp.zeros_like(l_sc)
    acc_sc[...] = jnp.zeros_like(acc_sc)
    if copy_q:
      q_sc[...] = q_ref[...]    # the q block stays on chip across kv steps

  def tile():
    mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                     **_segments(qs_ref, ks_ref))
    m, l, acc = forward_update(
        (q_sc if copy_q else q_ref)[...], k_ref[...],
        zero_rows(v_ref[...], kj, bk, sk), m_sc[...], l_sc[...], acc_sc[...],
        mask, sm_scale)
    m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

  _run_if(_tile_needed(qi, kj, bq=bq, bk=bk, causal=causal), tile)

  @pl.when(kj == nk - 1)
  def _():
    o, lse = forward_result(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = o.astype(o_ref.dtype)
    _set_rows(lse_ref, lse)


def _q_major_specs(hm, bq, bk, d, g, q_seg, kv_seg):
  """Specs of a kernel on grid (batch, heads, q_blocks, kv_blocks): q-like
  blocks, kv blocks (head // g under GQA), (b, h, seq) rows, segments."""
  q_spec = _seq_spec(hm, bq, d, lambda b_, h_, i, j: (b_, h_, i))
  kv_spec = _seq_spec(hm, bk, d, lambda b_, h_, i, j: (b_, h_ // g, j))
  row_spec = _row_spec(hm, bq, lambda b_, h_, i, j: (b_, h_, i))
  seg_args, seg_specs = _seg_args(hm, q_seg, kv_seg,
                                  lambda b_, h_, i, j: (b_, i),
                                  lambda b_, h_, i, j: (b_, j), bq, bk)
  return q_spec, kv_spec, row_spec, seg_args, seg_specs


def forward(q, k, v, q_seg=None, kv_seg=None, *, causal=False, sm_scale,
            backend=None, block_q=None, block_k=None, loops=None):
  """The forward kernel: returns (out, lse) with lse of shape (b, h, sq)
  ((b, h, 1, sq) on the Mosaic TPU backends: see "layouts"). `loops`
  (default: on Triton) runs the in-kernel loops of
  `flash_attention_loops`; False, the grid kernel, which reverse mode can
  differentiate (the loops' trip counts depend on the program id)."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  hm = _head_major(backend)
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("flash_attention", q.shape, q.dtype, be,
                              block_q, block_k)
  size = q.dtype.itemsize
  bq, bk = attention_blocks(sq, sk, d, be, tuned.get("block_q", block_q),
                            tuned.get("block_k", block_k), itemsize=size)
  params = _triton_params("fwd", be, d, bq, bk, tuned, size)
  if blocking.is_triton(be) if loops is None else loops:
    return flash_attention_loops.forward(
        q, k, v, q_seg, kv_seg, causal=causal, sm_scale=sm_scale,
        backend=backend, bq=bq, bk=bk, compiler_params=params)
  nq, nk = pl.cdiv(sq, bq), pl.cdiv(sk, bk)
  q_spec, kv_spec, lse_spec, seg_args, seg_specs = _q_major_specs(
      hm, bq, bk, d, g, q_seg, kv_seg)
  q, k, v = _to_layout(hm, q, k, v)
  # On "mosaic_gpu" the q block, which does not move along the kv steps,
  # is loaded once and stays in shared memory: no copy of it.
  copy_q = not blocking.is_mosaic_gpu(be)
  kernel = functools.partial(_fwd_kernel, sm_scale=sm_scale, causal=causal,
                             has_seg=q_seg is not None, bq=bq, bk=bk, sq=sq,
                             sk=sk, nk=nk, copy_q=copy_q)
  o, lse = pl.pallas_call(
      kernel,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(_row_shape(hm, b, h, sq), jnp.float32)),
      grid=(b, h, nq, nk),
      in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
      out_specs=(q_spec, lse_spec),
      scratch_shapes=[pltpu.VMEM((bq,), jnp.float32),
                      pltpu.VMEM((bq,), jnp.float32),
                      pltpu.VMEM((bq, d), jnp.float32)]
      + ([pltpu.VMEM((bq, d), q.dtype)] if copy_q else []),
      compiler_params=params, backend=backend,
      name="flash_attention_fwd")(q, k, v, *seg_args)
  return _to_layout(hm, o)[0], lse


# ---------------------------------------------------------------- backward

def _delta_kernel(o_ref, do_ref, delta_ref):
  _set_rows(delta_ref, jnp.sum(o_ref[...].astype(jnp.float32)
                               * do_ref[...].astype(jnp.float32), axis=1))


def _dkdv_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk, nq, nt):
  """Works on transposed tiles (kv rows x q rows), so the kv block is the M
  side of every dot: sT = k q^T, dV += pT do, dpT = v do^T, dK += dsT q."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qs_ref, ks_ref = refs[6:8] if has_seg else (None, None)
  dk_ref, dv_ref, dk_sc, dv_sc = refs[-4:]
  kj, t = pl.program_id(2), pl.program_id(3)
  qi = t % nq

  @pl.when(t == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  def tile():
    mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                     mask_q=True, kv_major=True, **_segments(qs_ref, ks_ref))
    dk, dv = dkdv_update(
        zero_rows(q_ref[...], qi, bq, sq), k_ref[...], v_ref[...],
        zero_rows(do_ref[...], qi, bq, sq), _rows(lse_ref),
        zero_rows(_rows(delta_ref), qi, bq, sq), mask, sm_scale)
    dk_sc[...] += dk
    dv_sc[...] += dv

  _run_if(_tile_needed(qi, kj, bq=bq, bk=bk, causal=causal), tile)

  @pl.when(t == nt - 1)
  def _():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, sm_scale, causal, has_seg, bq, bk, sq, sk, nk):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qs_ref, ks_ref = refs[6:8] if has_seg else (None, None)
  dq_ref, dq_sc = refs[-2:]
  qi, kj = pl.program_id(2), pl.program_id(3)

  @pl.when(kj == 0)
  def _():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def tile():
    mask = tile_mask(qi, kj, bq=bq, bk=bk, sq=sq, sk=sk, causal=causal,
                     **_segments(qs_ref, ks_ref))
    dq_sc[...] += dq_update(
        q_ref[...], zero_rows(k_ref[...], kj, bk, sk),
        zero_rows(v_ref[...], kj, bk, sk), do_ref[...], _rows(lse_ref),
        _rows(delta_ref), mask, sm_scale)

  _run_if(_tile_needed(qi, kj, bq=bq, bk=bk, causal=causal), tile)

  @pl.when(kj == nk - 1)
  def _():
    dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def backward(q, k, v, q_seg, kv_seg, o, lse, do, *, causal, sm_scale,
             backend=None, block_q=None, block_k=None):
  """The backward kernels: returns (dq, dk, dv)."""
  b, sq, h, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  resolved = blocking.resolve_backend(backend)
  hm = _head_major(backend)
  q, k, v, o, do = _to_layout(hm, q, k, v, o, do)

  def setup(kernel):
    tuned = blocking.gpu_config(f"flash_attention.{kernel}", (b, sq, h, d),
                                q.dtype, resolved, block_q, block_k)
    bq, bk = attention_blocks(sq, sk, d, resolved,
                              tuned.get("block_q", block_q),
                              tuned.get("block_k", block_k), kernel,
                              q.dtype.itemsize)
    common = dict(sm_scale=sm_scale, causal=causal, has_seg=q_seg is not None,
                  bq=bq, bk=bk, sq=sq, sk=sk)
    return (bq, bk, pl.cdiv(sq, bq), pl.cdiv(sk, bk), common,
            _triton_params(kernel, resolved, d, bq, bk, tuned,
                           q.dtype.itemsize))

  bq, bk, nq, nk, common, params = setup("dkdv")

  # delta = rowsum(o * do), laid out like lse.
  q3 = _seq_spec(hm, bq, d, lambda b_, h_, i: (b_, h_, i))
  delta = pl.pallas_call(
      _delta_kernel,
      jax.ShapeDtypeStruct(_row_shape(hm, b, h, sq), jnp.float32),
      grid=(b, h, nq), in_specs=[q3, q3],
      out_specs=_row_spec(hm, bq, lambda b_, h_, i: (b_, h_, i)),
      backend=backend, name="flash_attention_bwd_delta")(o, do)
  if blocking.is_triton(resolved):
    kw = dict(causal=causal, sm_scale=sm_scale, backend=backend)
    dk, dv = flash_attention_loops.backward_dkdv(
        q, k, v, do, lse, delta, q_seg, kv_seg, bq=bq, bk=bk,
        compiler_params=params, **kw)
    bq, bk, _, _, _, params = setup("dq")
    dq = flash_attention_loops.backward_dq(
        q, k, v, do, lse, delta, q_seg, kv_seg, bq=bq, bk=bk,
        compiler_params=params, **kw)
    return dq, dk, dv
  dq, dk, dv = _grid_backward(q, k, v, q_seg, kv_seg, do, lse, delta,
                              dims=(b, h, hkv, d), hm=hm, backend=backend,
                              setup=setup)
  return _to_layout(hm, dq, dk, dv)


def _grid_backward(q, k, v, q_seg, kv_seg, do, lse, delta, *, dims, hm,
                   backend, setup):
  """dK/dV and dQ as grid kernels (the backends other than Triton), in the
  kernels' layout; `dims` = (batch, heads, kv_heads, head_dim)."""
  b, h, hkv, d = dims
  g = h // hkv
  bq, bk, nq, nk, common, params = setup("dkdv")
  # dK, dV: grid (b, kv_heads, kv_blocks, group * q_blocks).
  nt = g * nq
  q_index = lambda b_, hk, j, t: (b_, hk * g + t // nq, t % nq)
  q_spec = _seq_spec(hm, bq, d, q_index)
  kv_spec = _seq_spec(hm, bk, d, lambda b_, hk, j, t: (b_, hk, j))
  row_spec = _row_spec(hm, bq, q_index)
  seg_args, seg_specs = _seg_args(hm, q_seg, kv_seg,
                                  lambda b_, hk, j, t: (b_, t % nq),
                                  lambda b_, hk, j, t: (b_, j), bq, bk)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, nq=nq, nt=nt, **common),
      (jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(b, hkv, nk, nt),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                *seg_specs],
      out_specs=(kv_spec, kv_spec),
      scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32),
                      pltpu.VMEM((bk, d), jnp.float32)],
      compiler_params=params, backend=backend,
      name="flash_attention_bwd_dkdv")(
          q, k, v, do, lse, delta, *seg_args)

  # dQ: grid (b, heads, q_blocks, kv_blocks).
  bq, bk, nq, nk, common, params = setup("dq")
  q_spec, kv_spec, row_spec, seg_args, seg_specs = _q_major_specs(
      hm, bq, bk, d, g, q_seg, kv_seg)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, nk=nk, **common),
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, h, nq, nk),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                *seg_specs],
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
      compiler_params=params, backend=backend,
      name="flash_attention_bwd_dq")(
          q, k, v, do, lse, delta, *seg_args)
  return dq, dk, dv


# ---------------------------------------------------------------- autodiff

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _flash(q, k, v, q_seg, kv_seg, causal, sm_scale, backend, block_q,
           block_k):
  return forward(q, k, v, q_seg, kv_seg, causal=causal, sm_scale=sm_scale,
                 backend=backend, block_q=block_q, block_k=block_k)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, causal, sm_scale, backend, block_q,
               block_k):
  o, lse = forward(q, k, v, q_seg, kv_seg, causal=causal, sm_scale=sm_scale,
                   backend=backend, block_q=block_q, block_k=block_k)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(causal, sm_scale, backend, block_q, block_k, res, do):
  q, k, v, q_seg, kv_seg, o, lse = res
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, o, lse, do, causal=causal,
                        sm_scale=sm_scale, backend=backend, block_q=block_q,
                        block_k=block_k)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_shapes(q, k, v):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("flash_attention: q, k, v must be (batch, seq, heads, "
                     f"head_dim); got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"flash_attention: k {k.shape} and v {v.shape} differ")
  b, _, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"flash_attention: q {q.shape} and k {k.shape} disagree "
                     "on batch or head_dim")
  if h % k.shape[2]:
    raise ValueError(f"flash_attention: {h} q heads are not a multiple of "
                     f"{k.shape[2]} kv heads")


@blocking.per_platform("flash_attention")
def flash_attention(q, k, v, *, causal: bool = False, segment_ids=None,
                    sm_scale: float | None = None, backend=None,
                    block_q: int | None = None, block_k: int | None = None):
  """softmax(q k^T * sm_scale, masked) v for `(batch, seq, heads, head_dim)`.

  `k`/`v` may have fewer heads than `q` (GQA/MQA; q head `i` uses kv head
  `i // (heads // kv_heads)`). `segment_ids`: `(batch, seq)` ints when q and
  kv have the same length, or a pair `(q_segment_ids, kv_segment_ids)`;
  a query attends only to keys of its own segment. `sm_scale` defaults to
  `1/sqrt(head_dim)`. Differentiable in q, k, v (`custom_vjp` with the
  backward kernels above).
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  check_shapes(q, k, v)
  sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(
      sm_scale)
  q_seg, kv_seg = _split_segments(segment_ids, q.shape[1], k.shape[1])
  backend = blocking.choose_backend("flash_attention", backend)
  if block_q is None and block_k is None:
    cfg = blocking.tuned("flash_attention", q.shape, q.dtype, backend)
    block_q, block_k = cfg.get("block_q"), cfg.get("block_k")
  return _flash(q, k, v, q_seg, kv_seg, bool(causal), sm_scale, backend,
                block_q, block_k)
