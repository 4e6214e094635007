"""The matrix of Pallas's TPU ops on dsl: beyond each op's one cheap case
(cases.py), more shapes and dtypes, the ops' optional features
(segment ids, causal masks, soft caps, sliding windows, quantized KV caches,
megacore modes, the splash masks) and their gradients: through the op's own
custom_vjp where it has one (flash attention, splash attention), through
dsl's automatic reverse mode where it has none (Pallas has none there, so
those are compared with the reference's gradient only).

`MATRIX` maps "op [variant]" to (module of `jax.experimental.pallas.ops`,
the case); tests run every entry under `pytest -m slow`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pallas_library import swap
from benchmarks.pallas_library.case import NO_PALLAS_GRAD, Case, rand, vjp_case

f32, bf16 = jnp.float32, jnp.bfloat16


def sibling(m, name: str):
  """Module `name` of the ops, from the same side (swapped or Pallas's) as
  the module `m`."""
  swapped = m.__name__.startswith(swap.PREFIX)
  return swap.swapped(name) if swapped else swap.original(name)


# --- paged attention ------------------------------------------------------

def paged_pages(dtype=f32):
  """Paged K/V: 2 sequences of up to 4 pages of 16 tokens, 2 KV heads."""
  q = rand(0, (2, 4, 128), dtype)
  k_pages, v_pages = (rand(i, (2, 8, 16, 128), dtype) for i in (1, 2))
  lengths = jnp.array([20, 50], jnp.int32)
  page_indices = jnp.array([[7, 1, 4, 2], [0, 6, 3, 5]], jnp.int32)
  return q, k_pages, v_pages, lengths, page_indices


def paged_dense(pages, page_indices):
  """[kv_heads, pages, page, dim] -> [batch, kv_heads, seq, dim]."""
  g = pages[:, page_indices]            # kv_heads, batch, pages, page, dim
  g = g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])
  return g.transpose(1, 0, 2, 3)


def _as_bf16(x):
  """What the kernel reads of K and V: bfloat16."""
  return x.astype(bf16).astype(f32)


def _paged(quantized=False, grad=False, soft_cap=None, **kw):
  q, k_pages, v_pages, lengths, page_indices = paged_pages()

  def kv(m, k, v):
    if not quantized:
      return k, v
    qu = sibling(m, "tpu.paged_attention.quantization_utils")
    return qu.quantize_to_int8(k), qu.quantize_to_int8(v)

  def op(m, _, q, k):
    k, v = kv(m, k, v_pages)
    return m.paged_attention(q, k, v, lengths, page_indices,
                             pages_per_compute_block=2,
                             attn_logits_soft_cap=soft_cap, **kw)

  def reference(m, q, k):
    util = sibling(m, "tpu.paged_attention.util")
    k, v = kv(m, k, v_pages)
    # The kernel reads K and V as bfloat16, or dequantizes them in float32.
    if quantized:
      qu = sibling(m, "tpu.paged_attention.quantization_utils")
      k, v = (qu.unquantize_from_int8(x, dtype=f32) for x in (k, v))
    else:
      k, v = _as_bf16(k), _as_bf16(v)
    dense = lambda p: paged_dense(p, page_indices)
    return util.grouped_query_attention_reference(
        q, dense(k), dense(v), lengths, soft_cap=soft_cap)

  if grad:
    argnums = (0,) if quantized else (0, 1)
    return vjp_case(op, reference, (q, k_pages), argnums, tol=1e-2)
  return Case(op, reference, tol=1e-2, args=(q, k_pages))


# --- flash attention -------------------------------------------------------

def _flash(dtype=f32, causal=True, segments=False, bias=False, grad=False,
           seq=128, block_k=128, sm_scale=1.0):
  q, k, v = (rand(i, (1, 2, seq, 128), dtype) for i in range(3))
  ab = rand(3, (1, 2, seq, seq), dtype) if bias else None
  ids = (jnp.arange(seq, dtype=jnp.int32) * 3 // seq)[None]

  def seg(m):
    return m.SegmentIds(q=ids, kv=ids) if segments else None

  def op(m, _, q, k, v):
    sizes = m.BlockSizes(block_q=128, block_k_major=block_k, block_k=block_k,
                         block_b=1, block_q_major_dkv=128,
                         block_k_major_dkv=block_k, block_k_dkv=block_k,
                         block_q_dkv=128, block_k_major_dq=block_k,
                         block_k_dq=block_k, block_q_dq=128)
    return m.flash_attention(q, k, v, ab, seg(m), causal=causal,
                             sm_scale=sm_scale, block_sizes=sizes)

  def reference(m, q, k, v):
    return m.mha_reference(q, k, v, ab, seg(m), causal=causal,
                           sm_scale=sm_scale)

  tol = 2e-2 if dtype == bf16 else 2e-3
  # In bfloat16 Pallas's op differs from its reference by up to 0.1 (dsl and
  # Pallas agree to 1e-5).
  ref_tol = 0.15 if dtype == bf16 else None
  if grad:
    return vjp_case(op, reference, (q, k, v), (0, 1, 2), tol=tol)
  return Case(op, reference, tol=tol, ref_tol=ref_tol, args=(q, k, v))


# --- splash attention ------------------------------------------------------

def _splash(mask="causal", heads=2, seq=256, segments=False, soft_cap=None,
            mqa=False, grad=False, fused_bwd=False, dtype=f32):
  q = rand(0, (heads, seq, 128), dtype)
  kv_shape = (seq, 128) if mqa else (heads, seq, 128)
  k, v = rand(1, kv_shape, dtype), rand(2, kv_shape, dtype)
  ids = (jnp.arange(seq, dtype=jnp.int32) * 3 // seq)

  def masks(m):
    shape = (seq, seq)
    mask_lib = sibling(m, "tpu.splash_attention.splash_attention_mask")
    one = {"causal": lambda: m.CausalMask(shape),
           "local": lambda: m.LocalMask(shape, window_size=(64, 32),
                                        offset=0),
           "chunked": lambda: mask_lib.ChunkedCausalMask(shape, 128),
           "full": lambda: m.FullMask(shape),
           "numpy": lambda: m.NumpyMask(np.tril(
               np.random.default_rng(0).random(shape) < 0.6) | np.eye(
                   seq, dtype=bool))}[mask]
    return m.MultiHeadMask([one() for _ in range(heads)])

  def seg(m):
    return m.SegmentIds(q=ids, kv=ids) if segments else None

  def op(m, interpret, q, k, v):
    sizes = m.BlockSizes(
        block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
        block_kv_dkv=128, block_kv_dkv_compute=128,
        block_q_dq=None if fused_bwd else 128,
        block_kv_dq=None if fused_bwd else 128, use_fused_bwd_kernel=fused_bwd)
    make = (m.make_splash_mqa_single_device if mqa
            else m.make_splash_mha_single_device)
    kernel = make(masks(m), block_sizes=sizes, attn_logits_soft_cap=soft_cap,
                  interpret=interpret)
    return kernel(q, k, v, seg(m))

  def reference(m, q, k, v):
    make = m.make_masked_mqa_reference if mqa else m.make_masked_mha_reference
    return make(masks(m))(q, k, v, seg(m), attn_logits_soft_cap=soft_cap)

  tol = 2e-2 if dtype == bf16 else 2e-3
  if grad:
    return vjp_case(op, reference, (q, k, v), (0, 1, 2), tol=tol)
  return Case(op, reference, tol=tol, args=(q, k, v))


# --- ragged paged attention -------------------------------------------------

def _ragged(grad=False, dtype=f32, **kw):
  """2 sequences: a prefill of 5 tokens, a decode of 1; 8 KV pages of 16."""
  q = rand(0, (8, 4, 128), dtype)
  kv_pages = rand(1, (8, 16, 4, 128), dtype)
  rest = (jnp.array([30, 17], jnp.int32),
          jnp.array([[0, 3, 0, 0], [5, 2, 0, 0]], jnp.int32),
          jnp.array([0, 5, 6], jnp.int32), jnp.array([2], jnp.int32))

  def op(m, _, q, kv):
    return m.ragged_paged_attention(q, kv, *rest, num_kv_pages_per_block=2,
                                    num_queries_per_block=8, **kw)[:6]

  def reference(m, q, kv):
    return m.ref_ragged_paged_attention(q, kv, *rest, **kw)[:6]

  tol = 2e-2 if dtype == bf16 else 2e-3
  if grad:
    return vjp_case(op, reference, (q, kv_pages), (0, 1), tol=tol)
  return Case(op, reference, tol=tol, args=(q, kv_pages))


# --- megablox --------------------------------------------------------------

def _group_rows(sizes):
  """The group of each row, for groups of `sizes` rows."""
  return jnp.repeat(jnp.arange(len(sizes)), jnp.array(sizes),
                    total_repeat_length=sum(sizes))


def _gmm(sizes=(96, 160), offset=None, k=128, transpose_rhs=False,
         dtype=f32, existing=False, grad=False):
  """gmm over groups of `sizes` rows; with `offset`, the rhs holds the
  groups from `offset` on only (a shard): the other rows are zeros, or
  `existing_out`'s."""
  groups = len(sizes) - (offset or 0)
  lhs = rand(0, (sum(sizes), k), dtype)
  rhs = rand(1, (groups, 128, k) if transpose_rhs else (groups, k, 128),
             dtype)
  group_sizes = jnp.array(sizes, jnp.int32)
  start = None if offset is None else jnp.array(offset, jnp.int32)
  existing_out = rand(2, (sum(sizes), 128)) if existing else None

  def op(m, interpret, lhs, rhs):
    # Positional: the custom_vjp of megablox.ops takes no keywords.
    return m.gmm(lhs, rhs, group_sizes, f32, (128, 128, 128), start,
                 existing_out, transpose_rhs, interpret)

  def reference(m, lhs, rhs):
    rows = _group_rows(sizes) - (offset or 0)
    mine = (rows >= 0)[:, None]
    r = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    out = jnp.einsum("mk,mkn->mn", lhs.astype(f32),
                     r[jnp.maximum(rows, 0)].astype(f32), precision="highest")
    return jnp.where(mine, out, 0.0 if existing_out is None else existing_out)

  tol = 2e-2 if dtype == bf16 else 2e-3
  if grad:
    return vjp_case(op, reference, (lhs, rhs), (0, 1), tol=2e-2)
  return Case(op, reference, tol=tol, args=(lhs, rhs))


def _tgmm(sizes=(96, 160), offset=None, dtype=f32):
  """tgmm over groups of `sizes` rows, from group `offset` on."""
  groups = len(sizes) - (offset or 0)
  lhs, rhs = rand(0, (128, sum(sizes)), dtype), rand(1, (sum(sizes), 128),
                                                     dtype)
  group_sizes = jnp.array(sizes, jnp.int32)
  start = None if offset is None else jnp.array(offset, jnp.int32)

  def op(m, interpret, lhs, rhs):
    return m.tgmm(lhs, rhs, group_sizes, f32, (128, 128, 128), start,
                  groups if offset else None, None, interpret)

  def reference(m, lhs, rhs):
    rows = _group_rows(sizes) - (offset or 0)
    onehot = (rows[:, None] == jnp.arange(groups)).astype(f32)
    return jnp.einsum("km,mg,mn->gkn", lhs.astype(f32), onehot,
                      rhs.astype(f32), precision="highest")
  return Case(op, reference, tol=2e-2 if dtype == bf16 else 2e-3,
              args=(lhs, rhs))


# --- matmul, example kernel, all-gather, random bits -------------------------

def _matmul(m_=256, k_=256, n_=256, block=(128, 128), block_k=128,
            dtype=f32, grad=False, out_dtype=None):
  x, y = rand(0, (m_, k_), dtype), rand(1, (k_, n_), dtype)

  def op(m, _, x, y):
    return m.matmul(x, y, block_shape=block, block_k=block_k,
                    out_dtype=out_dtype)

  def reference(m, x, y):
    return jnp.dot(x, y, precision="highest",
                   preferred_element_type=f32).astype(out_dtype or dtype)

  tol = 5e-2 if bf16 in (dtype, out_dtype) else 2e-3
  if grad:
    return vjp_case(op, reference, (x, y), (0, 1), tol=tol)
  return Case(op, reference, tol=tol, args=(x, y))


def _double(shape=(16, 256), dtype=f32, grad=False):
  x = rand(0, shape, dtype)
  if grad:
    return vjp_case(lambda m, _, x: m.double(x), lambda m, x: 2 * x, (x,),
                    (0,))
  return Case(lambda m, _, x: m.double(x), lambda m, x: 2 * x, tol=0,
              args=(x,))


def _all_gather(devices=8, rows=64, dtype=f32):
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
  x = jax.device_put(rand(0, (rows, 128), dtype),
                     jax.sharding.NamedSharding(mesh, jax.P("x")))
  return Case(lambda m, _, x: m.all_gather(x, mesh=mesh, axis_name="x"),
              lambda m, x: x, tol=0, args=(x,))


def _threefry(shape):
  key = jnp.array([5, 11], jnp.uint32)

  def reference(m, key):
    return jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"),
                           shape, jnp.uint32)
  # Past two dims the op numbers its counters otherwise than
  # jax.random.bits (Pallas's op does the same): Pallas is the reference.
  return Case(lambda m, _, key: m.plthreefry_random_bits(key, 32, shape),
              reference if len(shape) <= 2 else None, tol=0, args=(key,))


def _philox(shape):
  key = jnp.array([5, 11], jnp.uint32)
  return Case(lambda m, _, key: m.philox_random_bits(key, 32, shape), tol=0,
              args=(key,))


# "op [variant]" -> (module of jax.experimental.pallas.ops, the case).
_P = functools.partial
_VARIANTS: dict[str, tuple[str, Callable[[], Case]]] = {
    "tpu.matmul [bfloat16]": ("tpu.matmul", _P(_matmul, dtype=bf16)),
    "tpu.matmul [256x512 @ 512x384, 256 x 128 blocks]": (
        "tpu.matmul", _P(_matmul, k_=512, n_=384, block=(256, 128),
                         block_k=256)),
    "tpu.matmul [grad]": ("tpu.matmul", _P(_matmul, grad=True)),
    "tpu.matmul [bfloat16 in, float32 out_dtype]": (
        "tpu.matmul", _P(_matmul, dtype=bf16, out_dtype=f32)),
    "tpu.example_kernel [bfloat16, 64 x 384]": (
        "tpu.example_kernel", _P(_double, (64, 384), bf16)),
    "tpu.example_kernel [grad]": ("tpu.example_kernel",
                                  _P(_double, grad=True)),
    "tpu.all_gather [8 devices]": ("tpu.all_gather", _all_gather),
    "tpu.all_gather [2 devices, bfloat16]": (
        "tpu.all_gather", _P(_all_gather, 2, 16, bf16)),
    "tpu.flash_attention [segment ids]": (
        "tpu.flash_attention", _P(_flash, segments=True)),
    "tpu.flash_attention [non-causal, bias, sm_scale, 2 k blocks]": (
        "tpu.flash_attention", _P(_flash, causal=False, bias=True, seq=256,
                                  sm_scale=0.125)),
    "tpu.flash_attention [bfloat16]": ("tpu.flash_attention",
                                       _P(_flash, dtype=bf16)),
    "tpu.flash_attention [grad, causal]": ("tpu.flash_attention",
                                           _P(_flash, grad=True)),
    "tpu.flash_attention [grad, segment ids, bias, 2 k blocks]": (
        "tpu.flash_attention", _P(_flash, grad=True, segments=True,
                                  bias=True, seq=256)),
    "tpu.paged_attention [soft cap]": ("tpu.paged_attention",
                                       _P(_paged, soft_cap=2.0)),
    "tpu.paged_attention [quantized KV cache]": (
        "tpu.paged_attention", _P(_paged, quantized=True)),
    "tpu.paged_attention [megacore kv_head]": (
        "tpu.paged_attention", _P(_paged, megacore_mode="kv_head")),
    "tpu.paged_attention [megacore batch]": (
        "tpu.paged_attention", _P(_paged, megacore_mode="batch")),
    "tpu.paged_attention [grid over the sequence]": (
        "tpu.paged_attention", _P(_paged, inline_seq_dim=False)),
    "tpu.paged_attention (grad) [soft cap]": (
        "tpu.paged_attention", _P(_paged, grad=True, soft_cap=2.0)),
    "tpu.paged_attention (grad) [quantized KV cache]": (
        "tpu.paged_attention", _P(_paged, grad=True, quantized=True)),
    "tpu.paged_attention (grad) [megacore batch]": (
        "tpu.paged_attention", _P(_paged, grad=True, megacore_mode="batch")),
    "tpu.paged_attention (grad) [grid over the sequence]": (
        "tpu.paged_attention", _P(_paged, grad=True, inline_seq_dim=False)),
    "tpu.splash_attention [local mask (sliding window)]": (
        "tpu.splash_attention", _P(_splash, mask="local")),
    "tpu.splash_attention [chunked causal mask]": (
        "tpu.splash_attention", _P(_splash, mask="chunked")),
    "tpu.splash_attention [full mask, segment ids]": (
        "tpu.splash_attention", _P(_splash, mask="full", segments=True)),
    "tpu.splash_attention [numpy mask, soft cap]": (
        "tpu.splash_attention", _P(_splash, mask="numpy", soft_cap=3.0)),
    "tpu.splash_attention [multi-query]": (
        "tpu.splash_attention", _P(_splash, mqa=True)),
    "tpu.splash_attention [bfloat16]": ("tpu.splash_attention",
                                        _P(_splash, dtype=bf16)),
    "tpu.splash_attention [grad, causal]": (
        "tpu.splash_attention", _P(_splash, grad=True)),
    "tpu.splash_attention [grad, local mask, segment ids, soft cap]": (
        "tpu.splash_attention", _P(_splash, grad=True, mask="local",
                                   segments=True, soft_cap=3.0)),
    "tpu.splash_attention [grad, fused backward kernel]": (
        "tpu.splash_attention", _P(_splash, grad=True, fused_bwd=True)),
    "tpu.ragged_paged_attention [sliding window]": (
        "tpu.ragged_paged_attention.kernel", _P(_ragged, sliding_window=8)),
    "tpu.ragged_paged_attention [soft cap, sm_scale]": (
        "tpu.ragged_paged_attention.kernel", _P(_ragged, soft_cap=2.0,
                                                sm_scale=0.1)),
    "tpu.ragged_paged_attention [k_scale, v_scale, mask_value]": (
        "tpu.ragged_paged_attention.kernel", _P(_ragged, k_scale=0.5,
                                                v_scale=2.0,
                                                mask_value=-1e4)),
    "tpu.ragged_paged_attention [grad]": (
        "tpu.ragged_paged_attention.kernel", _P(_ragged, grad=True)),
    "tpu.megablox.gmm [bfloat16]": ("tpu.megablox.gmm",
                                    _P(_gmm, dtype=bf16)),
    "tpu.megablox.gmm [transpose_rhs, k of 192 (a partial k tile)]": (
        "tpu.megablox.gmm", _P(_gmm, transpose_rhs=True, k=192)),
    "tpu.megablox.gmm [group offset: groups 1-2 of 3]": (
        "tpu.megablox.gmm", _P(_gmm, (128, 96, 160), offset=1)),
    "tpu.megablox.gmm [group offset, existing_out]": (
        "tpu.megablox.gmm", _P(_gmm, (128, 96, 160), offset=1,
                               existing=True)),
    "tpu.megablox.tgmm [bfloat16]": ("tpu.megablox.gmm",
                                     _P(_tgmm, dtype=bf16)),
    "tpu.megablox.tgmm [group offset, num_actual_groups: groups 1-2 of 3]": (
        "tpu.megablox.gmm", _P(_tgmm, (128, 96, 160), offset=1)),
    "tpu.megablox.gmm (grad) [transpose_rhs]": (
        "tpu.megablox.ops", _P(_gmm, transpose_rhs=True, grad=True)),
    "tpu.megablox.gmm (grad) [group offset: groups 1-2 of 3]": (
        "tpu.megablox.ops", _P(_gmm, (128, 96, 160), offset=1, grad=True)),
    "tpu.random.threefry [3-D, 2 x 16 x 256]": (
        "tpu.random.threefry", _P(_threefry, (2, 16, 256))),
    "tpu.random.threefry [padded, 20 x 1000]": (
        "tpu.random.threefry", _P(_threefry, (20, 1000))),
    "tpu.random.philox [3-D, 2 x 16 x 256]": (
        "tpu.random.philox", _P(_philox, (2, 16, 256))),
}

MATRIX = _VARIANTS

# Variants compared with their reference only, and why (beyond their op's
# reason in pallas_ops_swap.NO_PALLAS).
NO_PALLAS = {
    "tpu.matmul [grad]": NO_PALLAS_GRAD,
    "tpu.example_kernel [grad]": NO_PALLAS_GRAD,
    "tpu.ragged_paged_attention [grad]": NO_PALLAS_GRAD,
}

# Variants that run on a megacore chip: the TensorCores per device that
# mosaic_interpret (`lowering_mosaic.interpreter_options(num_cores=...)`)
# and Pallas's TPU interpret mode (`InterpretParams(num_cores_or_threads=
# ...)`) simulate; 1 for the others. The megacore modes split a leading
# "parallel" grid dim of two between the cores, each of which keeps its own
# "initialized" flag in SMEM: on one core the second half finds the flag
# cleared and waits for a DMA it never started.
NUM_CORES = {
    "tpu.paged_attention [megacore kv_head]": 2,
    "tpu.paged_attention [megacore batch]": 2,
    "tpu.paged_attention (grad) [megacore batch]": 2,
}
