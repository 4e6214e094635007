"""kernels.flash_attention: values, gradients (GQA, causal, segments, masks)."""
import importlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import kernels
from tests.pallas.testing import (KERNEL_GRAD_SETTINGS, KERNEL_SETTINGS,
                                  OTHER_CPU_BACKENDS, array, assert_close,
                                  assert_tree_close, automatic_vjp_or_xfail,
                                  jitted, kernel_dtypes, rng, run_or_skip,
                                  vjp_with)

flash_mod = importlib.import_module("kernels.flash_attention")

HEADS = [(1, 1), (2, 2), (4, 2), (3, 1)]        # (q heads, kv heads)
BLOCKS = [(None, None), (8, 8), (16, 8)]


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
  ks = [(seed, i) for i in range(4)]
  q = array(ks[0], (b, sq, h, d), dtype)
  k = array(ks[1], (b, sk, hkv, d), dtype)
  v = array(ks[2], (b, sk, hkv, d), dtype)
  do = array(ks[3], (b, sq, h, d), dtype)
  return q, k, v, do


def _segments(b, sq, sk, seed):
  """Sorted segment ids; every q segment also occurs among the keys."""
  r = rng(("segments", seed))
  q_seg = np.sort(r.integers(0, 3, (b, sq)), axis=1).astype(np.int32)
  kv_seg = np.sort(r.integers(0, 3, (b, sk)), axis=1).astype(np.int32)
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


@st.composite
def configs(draw):
  h, hkv = draw(st.sampled_from(HEADS))
  sq = draw(st.integers(1, 40))
  causal = draw(st.booleans())
  same = causal or draw(st.booleans())
  sk = sq if same else draw(st.integers(1, 40))
  return dict(b=draw(st.integers(1, 2)), sq=sq, sk=sk, h=h, hkv=hkv,
              d=draw(st.sampled_from([4, 8, 16])), causal=causal,
              segments=draw(st.booleans()),
              blocks=draw(st.sampled_from(BLOCKS)))


def _kw(c, q_seg_kv_seg):
  return dict(causal=c["causal"],
              segment_ids=q_seg_kv_seg if c["segments"] else None)


@KERNEL_SETTINGS
@given(c=configs(), dtype=kernel_dtypes)
def test_forward_matches_reference(c, dtype):
  q, k, v, _ = _inputs(c["b"], c["sq"], c["sk"], c["h"], c["hkv"], c["d"],
                       dtype, c["sq"] + c["sk"])
  kw = _kw(c, _segments(c["b"], c["sq"], c["sk"], c["d"]))
  bq, bk = c["blocks"]
  f = jax.jit(lambda q, k, v: kernels.flash_attention(
      q, k, v, backend="interpret", block_q=bq, block_k=bk, **kw))
  assert_close(f(q, k, v), jitted(flash_mod.reference, **kw)(q, k, v), dtype,
               tol={jnp.float32: 2e-5, jnp.bfloat16: 3e-2})


@KERNEL_GRAD_SETTINGS
@given(c=configs())
def test_gradients_match_reference(c):
  q, k, v, do = _inputs(c["b"], c["sq"], c["sk"], c["h"], c["hkv"], c["d"],
                        jnp.float32, c["sq"] * c["sk"])
  kw = _kw(c, _segments(c["b"], c["sq"], c["sk"], c["d"]))
  bq, bk = c["blocks"]
  fn = lambda q, k, v: kernels.flash_attention(q, k, v, block_q=bq,
                                               block_k=bk, **kw)
  got = jax.jit(lambda *a: vjp_with(fn, a, do))(q, k, v)
  want = jax.jit(lambda *a: vjp_with(
      lambda q, k, v: flash_mod.reference(q, k, v, **kw), a, do))(q, k, v)
  assert_tree_close(got, want, tol=1e-4)


def test_bf16_gradients_gqa_causal_partial_blocks():
  q, k, v, do = _inputs(2, 37, 37, 4, 2, 16, jnp.bfloat16, 1)
  got = vjp_with(lambda q, k, v: kernels.flash_attention(
      q, k, v, causal=True, block_q=16, block_k=8), (q, k, v), do)
  want = vjp_with(lambda q, k, v: flash_mod.reference(q, k, v, causal=True),
                  (q, k, v), do)
  assert_tree_close(got, want, jnp.bfloat16, tol=5e-2)


def test_mqa_single_segment_array_and_sm_scale():
  q, k, v, do = _inputs(2, 24, 24, 4, 1, 8, jnp.float32, 2)
  seg = jnp.repeat(jnp.arange(3)[None], 8, axis=1).reshape(1, 24)
  seg = jnp.concatenate([seg, seg[:, ::-1]], axis=0)
  got = kernels.flash_attention(q, k, v, segment_ids=seg, sm_scale=0.3,
                                block_q=8, block_k=16)
  want = flash_mod.reference(q, k, v, segment_ids=seg, sm_scale=0.3)
  assert_close(got, want, tol=2e-5)


def test_hand_written_backward_matches_automatic():
  q, k, v, do = _inputs(1, 20, 20, 4, 2, 8, jnp.float32, 3)
  kv_seg = jnp.array([[0] * 12 + [1] * 8], jnp.int32)
  kw = dict(causal=True, sm_scale=0.35, block_q=8, block_k=8)
  raw = lambda q, k, v: flash_mod.forward(q, k, v, kv_seg, kv_seg, **kw)[0]
  auto = automatic_vjp_or_xfail(raw, (q, k, v), do)
  hand = vjp_with(lambda q, k, v: kernels.flash_attention(
      q, k, v, segment_ids=kv_seg, **kw), (q, k, v), do)
  assert_tree_close(hand, auto, tol=1e-4)


def test_rows_that_see_no_key_are_zero():
  q, k, v, _ = _inputs(1, 8, 8, 1, 1, 4, jnp.float32, 4)
  q_seg = jnp.array([[0, 0, 0, 0, 5, 5, 5, 5]], jnp.int32)
  kv_seg = jnp.zeros((1, 8), jnp.int32)
  got = kernels.flash_attention(q, k, v, segment_ids=(q_seg, kv_seg))
  assert_close(got[:, 4:], jnp.zeros_like(got[:, 4:]))
  assert_close(got, flash_mod.reference(q, k, v, segment_ids=(q_seg, kv_seg)))


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends(backend):
  q, k, v, _ = _inputs(1, 128, 128, 2, 1, 128, jnp.float32, 5)
  got = run_or_skip(lambda q, k, v: kernels.flash_attention(
      q, k, v, causal=True, backend=backend), q, k, v)
  assert_close(got, flash_mod.reference(q, k, v, causal=True), tol=2e-5)


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends_partial_blocks_and_backward(backend):
  q, k, v, do = _inputs(1, 100, 100, 4, 2, 32, jnp.float32, 6)
  fn = lambda q, k, v: kernels.flash_attention(q, k, v, causal=True,
                                               backend=backend)
  got = run_or_skip(lambda *a: vjp_with(fn, a, do), q, k, v)
  want = vjp_with(lambda q, k, v: flash_mod.reference(q, k, v, causal=True),
                  (q, k, v), do)
  assert_tree_close(got, want, tol=1e-4)


def test_tpu_layout_gqa_segments_and_backward():
  """On mosaic_interpret the operands go head-major (no TPU block squeezes
  its second-minor dim); values and gradients are those of the reference,
  with kv heads > 1, segments and a partial last block."""
  q, k, v, do = _inputs(2, 200, 200, 4, 2, 128, jnp.float32, 9)
  segs = _segments(2, 200, 200, 9)
  fn = lambda q, k, v: kernels.flash_attention(
      q, k, v, causal=True, segment_ids=segs, backend="mosaic_interpret",
      block_q=128, block_k=128)
  got = jax.block_until_ready(vjp_with(fn, (q, k, v), do))
  want = vjp_with(lambda q, k, v: flash_mod.reference(
      q, k, v, causal=True, segment_ids=segs), (q, k, v), do)
  assert_tree_close(got, want, tol=1e-4)


def test_tpu_layout_lse_is_head_major():
  q, k, v, _ = _inputs(1, 128, 128, 2, 2, 128, jnp.float32, 3)
  o, lse = flash_mod.forward(q, k, v, sm_scale=0.1, backend="mosaic_interpret")
  assert o.shape == q.shape and lse.shape == (1, 2, 1, 128)
  o2, lse2 = flash_mod.forward(q, k, v, sm_scale=0.1, backend="interpret")
  assert lse2.shape == (1, 2, 128)
  assert_close(o, o2, tol=2e-5)
  assert_close(lse[:, :, 0], lse2, tol=2e-5)


def test_vmap_of_forward_and_gradient():
  q = array(7, (2, 1, 12, 2, 8), jnp.float32)
  fn = lambda q: kernels.flash_attention(q, q, q, causal=True)
  ref = lambda q: flash_mod.reference(q, q, q, causal=True)
  assert_close(jax.vmap(fn)(q), jax.vmap(ref)(q), tol=2e-5)
  grad = lambda f: jax.vmap(jax.grad(lambda q: jnp.sum(f(q) ** 2)))
  assert_close(grad(fn)(q), grad(ref)(q), tol=1e-4)


# ------------------------------------------------------- causal block skipping

@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_causal_never_reads_kv_blocks_above_the_diagonal(backend):
  """Keys and values past the first q block's diagonal block hold NaN: had
  the first q block read them (even masked: 0 * NaN), its rows would be
  NaN. On Triton the loop bounds stop before them; the grid kernels skip
  the tile."""
  q, k, v, _ = _inputs(1, 64, 64, 2, 1, 16, jnp.float32, 11)
  poison = jnp.arange(64)[None, :, None, None] >= 16
  kp, vp = (jnp.where(poison, jnp.nan, x) for x in (k, v))
  got = jax.jit(lambda q, k, v: kernels.flash_attention(
      q, k, v, causal=True, backend=backend, block_q=16, block_k=16))(
          q, kp, vp)
  want = flash_mod.reference(q, k, v, causal=True)
  assert_close(got[:, :16], want[:, :16], tol=2e-5)


def test_causal_backward_never_reads_q_blocks_above_the_diagonal():
  """q and dO rows of the first q block hold NaN: the dK/dV of later kv
  blocks, which no row of that block sees, and the dQ of later rows stay
  those of the clean reference (the dK/dV loops start at the diagonal)."""
  q, k, v, do = _inputs(1, 64, 64, 4, 2, 16, jnp.float32, 12)
  poison = jnp.arange(64)[None, :, None, None] < 16
  qp, dop = (jnp.where(poison, jnp.nan, x) for x in (q, do))
  fn = lambda q, k, v: kernels.flash_attention(
      q, k, v, causal=True, backend="triton_interpret", block_q=16,
      block_k=16)
  got = jax.jit(lambda *a: vjp_with(fn, a, dop))(qp, k, v)
  want = vjp_with(lambda q, k, v: flash_mod.reference(q, k, v, causal=True),
                  (q, k, v), do)
  for g, w in zip(got, want):
    assert_close(g[:, 16:], w[:, 16:], tol=1e-4)


def _trips(bounds, n, **kw):
  """(tiles computed, tiles masked) over the programs 0..n-1 whose loops
  `bounds` gives: kv_bounds' (full, needed), or q_bounds' (masked,
  unmasked, masked) ranges."""
  total = masked = 0
  for i in range(n):
    b = bounds(i, **kw)
    loops = ([(b[0], True), (b[1], False), (b[2], True)]
             if isinstance(b[0], tuple) else
             [((0, b[0]), False), ((b[0], b[1]), True)])
    for (lo, hi), is_masked in loops:
      trips = max(0, int(hi) - int(lo))
      total += trips
      masked += trips if is_masked else 0
  return total, masked


@pytest.mark.parametrize("kernel", ["fwd", "dkdv"])
def test_causal_kernels_do_half_the_work_and_mask_only_the_diagonal(kernel):
  """At the benchmark's sequence (2048) and the Hopper tiles, causal
  programs compute about half the tiles of non-causal ones, and only the
  tiles the diagonal crosses are masked."""
  loops = importlib.import_module("kernels.flash_attention_loops")
  bq, bk = (128, 128) if kernel == "fwd" else (32, 128)
  bounds, n = ((loops.kv_bounds, 2048 // bq) if kernel == "fwd"
               else (loops.q_bounds, 2048 // bk))
  kw = dict(bq=bq, bk=bk, sq=2048, sk=2048, has_seg=False)
  causal, masked = _trips(bounds, n, causal=True, **kw)
  full, none_masked = _trips(bounds, n, causal=False, **kw)
  assert full == (2048 // bq) * (2048 // bk) and none_masked == 0
  assert 0.5 <= causal / full <= 0.55
  crossing = n * max(bq, bk) // min(bq, bk) if kernel == "dkdv" else n
  assert masked == crossing


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_triton_defaults_fit_shared_memory_by_dtype(d, itemsize):
  """The code's Triton tiles fit one Hopper program's shared memory for
  every kernel, dtype and head_dim (the estimate is exact for the forward:
  the sm_90 binaries' 160 KiB bf16 and 192 KiB f32 at head_dim 128), and
  keep the table's tiles where they fit."""
  for kernel in ("fwd", "dkdv", "dq"):
    bq, bk, warps, stages = flash_mod._triton_config(kernel, d, itemsize)
    assert flash_mod._shared_bytes(kernel, bq, bk, d, itemsize, stages) <= (
        flash_mod.SHARED_BYTES)
    table = (flash_mod.SMALL_CONFIG if d <= 64
             else flash_mod.TRITON_CONFIGS[kernel])
    assert (warps, stages) == table[2:]
    if itemsize == 2 and d <= 128:
      assert (bq, bk) == table[:2]
  assert flash_mod._shared_bytes("fwd", 128, 128, 128, 2, 2) == 160 * 1024
  assert flash_mod._triton_config("fwd", 128, 4)[:2] == (128, 64)


def test_triton_launch_fits_shared_memory_with_blocks_the_caller_chose():
  """Blocks given by the caller are kept; the pipeline gets fewer stages
  where three would not fit (float32, 128 x 128 tiles, head_dim 64: the
  dK/dV and dQ kernels' 256 KiB)."""
  for kernel in ("fwd", "dkdv", "dq"):
    params = flash_mod._triton_params(kernel, "triton", 64, 128, 128,
                                      itemsize=4)
    assert flash_mod._shared_bytes(kernel, 128, 128, 64, 4,
                                   params.num_stages) <= flash_mod.SHARED_BYTES
  assert flash_mod._triton_params("dkdv", "triton", 64, 128, 128,
                                  itemsize=4).num_stages == 2
  assert flash_mod._triton_params("fwd", "triton", 64, 128, 128,
                                  itemsize=2).num_stages == 3
