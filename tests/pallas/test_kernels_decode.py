"""kernels.decode_attention and kernels.paged_attention against jnp."""
import importlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import kernels
from tests.pallas.testing import (KERNEL_SETTINGS, OTHER_CPU_BACKENDS, array,
                                  assert_close, jitted, kernel_dtypes, rng,
                                  run_or_skip)

decode_mod = importlib.import_module("kernels.decode_attention")
paged_mod = importlib.import_module("kernels.paged_attention")

HEADS = [(1, 1), (4, 2), (4, 1), (6, 3)]


def _lengths(seed, b, s_max):
  lens = rng(seed).integers(0, s_max + 1, (b,)).astype(np.int32)
  lens[0] = s_max                   # one full sequence; others may be empty
  return jnp.asarray(lens)


@KERNEL_SETTINGS
@given(b=st.integers(1, 3), s_max=st.integers(1, 50),
       heads=st.sampled_from(HEADS), d=st.sampled_from([4, 16]),
       dtype=kernel_dtypes, block_k=st.sampled_from([None, 8, 16]))
def test_decode_matches_reference(b, s_max, heads, d, dtype, block_k):
  h, hkv = heads
  ks = [(s_max * 7 + b, i) for i in range(4)]
  q = array(ks[0], (b, h, d), dtype)
  kc = array(ks[1], (b, s_max, hkv, d), dtype)
  vc = array(ks[2], (b, s_max, hkv, d), dtype)
  lens = _lengths(ks[3], b, s_max)
  f = jax.jit(lambda *a: kernels.decode_attention(*a, backend="interpret",
                                                  block_k=block_k))
  assert_close(f(q, kc, vc, lens), jitted(decode_mod.reference)(q, kc, vc, lens),
               dtype, tol={jnp.float32: 2e-5, jnp.bfloat16: 3e-2})


def _page_table(seed, b, pages_per_seq, num_pages):
  perm = rng(seed).permutation(num_pages)[:b * pages_per_seq]
  return jnp.asarray(perm.reshape(b, pages_per_seq).astype(np.int32))


@KERNEL_SETTINGS
@given(b=st.integers(1, 3), page_size=st.sampled_from([4, 8]),
       pages_per_seq=st.integers(1, 6), heads=st.sampled_from(HEADS),
       dtype=kernel_dtypes,
       pages_per_block=st.sampled_from([None, 1, 2, 4]))
def test_paged_matches_reference(b, page_size, pages_per_seq, heads, dtype,
                                 pages_per_block):
  h, hkv = heads
  d = 8
  num_pages = b * pages_per_seq + 3
  ks = [(b * 31 + pages_per_seq, i) for i in range(5)]
  q = array(ks[0], (b, h, d), dtype)
  kp = array(ks[1], (hkv, num_pages, page_size, d), dtype)
  vp = array(ks[2], (hkv, num_pages, page_size, d), dtype)
  lens = _lengths(ks[3], b, pages_per_seq * page_size)
  table = _page_table(ks[4], b, pages_per_seq, num_pages)
  f = jax.jit(lambda *a: kernels.paged_attention(
      *a, backend="interpret", pages_per_compute_block=pages_per_block))
  assert_close(f(q, kp, vp, lens, table),
               jitted(paged_mod.reference)(q, kp, vp, lens, table), dtype,
               tol={jnp.float32: 2e-5, jnp.bfloat16: 3e-2})


def test_paged_ignores_table_entries_past_the_length():
  b, h, d, page_size, pps, num_pages = 2, 2, 8, 4, 4, 10
  ks = [(0, i) for i in range(4)]
  q = array(ks[0], (b, h, d), jnp.float32)
  kp = array(ks[1], (h, num_pages, page_size, d), jnp.float32)
  vp = array(ks[2], (h, num_pages, page_size, d), jnp.float32)
  lens = jnp.array([5, 9], jnp.int32)            # 2 and 3 pages used
  table = jnp.array([[3, 7, -1, 99], [0, 1, 2, 12345]], jnp.int32)
  got = kernels.paged_attention(q, kp, vp, lens, table)
  clean = jnp.where(table >= num_pages, 0, jnp.maximum(table, 0))
  assert_close(got, paged_mod.reference(q, kp, vp, lens, clean), tol=2e-5)


def test_decode_matches_flash_attention_last_row():
  # one decode step == the last query row of causal attention over the prefix
  b, s, h, hkv, d = 2, 12, 4, 2, 8
  ks = [(1, i) for i in range(3)]
  q = array(ks[0], (b, s, h, d), jnp.float32)
  k = array(ks[1], (b, s, hkv, d), jnp.float32)
  v = array(ks[2], (b, s, hkv, d), jnp.float32)
  full = kernels.flash_attention(q, k, v, causal=True)
  step = kernels.decode_attention(q[:, -1], k, v, jnp.full((b,), s))
  assert_close(step, full[:, -1], tol=2e-5)
  np.testing.assert_array_equal(
      kernels.decode_attention(q[:, 0], k, v, jnp.zeros((b,), jnp.int32)), 0)


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends(backend):
  ks = [(2, i) for i in range(5)]
  q = array(ks[0], (2, 8, 128), jnp.float32)
  kc = array(ks[1], (2, 256, 1, 128), jnp.float32)
  vc = array(ks[2], (2, 256, 1, 128), jnp.float32)
  lens = jnp.array([256, 100], jnp.int32)
  got = run_or_skip(lambda *a: kernels.decode_attention(*a, backend=backend),
                    q, kc, vc, lens)
  assert_close(got, decode_mod.reference(q, kc, vc, lens), tol=2e-5)
  kp = kc[:, :, 0].reshape(1, 2 * 16, 16, 128)
  vp = vc[:, :, 0].reshape(1, 2 * 16, 16, 128)
  table = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
  got = run_or_skip(lambda *a: kernels.paged_attention(*a, backend=backend),
                    q, kp, vp, lens, table)
  assert_close(got, paged_mod.reference(q, kp, vp, lens, table), tol=2e-5)


def test_tpu_layout_with_several_kv_heads():
  """mosaic_interpret transposes the caches head-major (a block squeezing
  the kv heads, the second-minor dim, breaks the TPU tiling rule)."""
  q = array((3, 0), (2, 4, 128), jnp.float32)
  kc = array((3, 1), (2, 384, 2, 128), jnp.float32)
  vc = array((3, 2), (2, 384, 2, 128), jnp.float32)
  lens = jnp.array([384, 130], jnp.int32)
  got = jax.block_until_ready(kernels.decode_attention(
      q, kc, vc, lens, backend="mosaic_interpret", block_k=128))
  assert_close(got, decode_mod.reference(q, kc, vc, lens), tol=2e-5)


def test_vmap_over_scalar_prefetch_lengths():
  q = array(8, (2, 1, 12, 2, 8), jnp.float32)
  lens = jnp.array([[3], [12]], jnp.int32)
  got = jax.vmap(lambda q, n: kernels.decode_attention(q[:, 0], q, q, n))(
      q, lens)
  want = jax.vmap(lambda q, n: decode_mod.reference(q[:, 0], q, q, n))(q, lens)
  assert_close(got, want, tol=2e-5)
