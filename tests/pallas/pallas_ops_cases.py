"""The cases of Pallas's kernel library run by import swap: one cheap shape
per op of `jax.experimental.pallas.ops` (served by pallas_ops_swap), how to
run it on dsl and on Pallas, and how to compare. Shared by
test_pallas_ops.py (values) and test_pallas_ops_golden.py (TPU modules).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pallas_tpu

import dsl as pl
from tests.pallas import pallas_ops_swap as swap


@dataclasses.dataclass(frozen=True)
class Case:
  """One op: `run(module, interpret)` calls it from `module` (swapped or
  Pallas's) on fixed inputs, passing `interpret` where the op takes it;
  `reference(module)` is the op's own reference (None: it has none)."""
  run: Callable[[Any, bool], Any]
  reference: Callable[[Any], Any] | None = None
  tol: float = 2e-3
  # Against the reference, where the op itself differs from it more.
  ref_tol: float | None = None


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


# --- TPU ops ---------------------------------------------------------------

def _matmul():
  x, y = _rand(0, (256, 256)), _rand(1, (256, 256))
  return Case(lambda m, _: m.matmul(x, y, block_shape=(128, 128),
                                    block_k=128),
              lambda m: jnp.dot(x, y, precision="highest"))


def _example_kernel():
  x = _rand(0, (8, 128))
  return Case(lambda m, _: m.double(x), lambda m: 2 * x)


def _all_gather():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  x = jax.device_put(_rand(0, (32, 128)),
                     jax.sharding.NamedSharding(mesh, jax.P("x")))
  return Case(lambda m, _: m.all_gather(x, mesh=mesh, axis_name="x"),
              lambda m: x)


def _flash_attention():
  q, k, v = (_rand(i, (1, 2, 128, 128)) for i in range(3))
  sizes = dict(block_q=128, block_k_major=128, block_k=128, block_b=1)

  def run(m, _):
    return m.flash_attention(q, k, v, causal=True,
                             block_sizes=m.BlockSizes(**sizes))
  return Case(run, lambda m: m.mha_reference(q, k, v, None, causal=True))


def _paged_pages():
  """Paged K/V: 2 sequences of up to 4 pages of 16 tokens, 2 KV heads."""
  q = _rand(0, (2, 4, 128))
  k_pages, v_pages = (_rand(i, (2, 8, 16, 128)) for i in (1, 2))
  lengths = jnp.array([20, 50], jnp.int32)
  page_indices = jnp.array([[7, 1, 4, 2], [0, 6, 3, 5]], jnp.int32)
  return q, k_pages, v_pages, lengths, page_indices


def _paged_dense(pages, page_indices):
  """[kv_heads, pages, page, dim] -> [batch, kv_heads, seq, dim]."""
  g = pages[:, page_indices]            # kv_heads, batch, pages, page, dim
  g = g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])
  return g.transpose(1, 0, 2, 3)


def _paged_attention():
  q, k_pages, v_pages, lengths, page_indices = _paged_pages()

  def run(m, _):
    return m.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                             pages_per_compute_block=2)

  def reference(m):
    util = swap.original("tpu.paged_attention.util")
    return util.grouped_query_attention_reference(
        q, _paged_dense(k_pages, page_indices),
        _paged_dense(v_pages, page_indices), lengths)
  # Pallas's op differs from its reference by up to 1.4e-2 here (dsl and
  # Pallas agree to 1e-5).
  return Case(run, reference, ref_tol=2e-2)


def _paged_attention_grad():
  q, k_pages, v_pages, lengths, page_indices = _paged_pages()

  def loss(f, q, k_pages):
    return jnp.sum(f(q, k_pages) ** 2)

  def run(m, _):
    f = lambda q, kp: m.paged_attention(q, kp, v_pages, lengths,
                                        page_indices,
                                        pages_per_compute_block=2)
    return jax.grad(functools.partial(loss, f), argnums=(0, 1))(q, k_pages)

  def reference(m):
    # The kernel reads K and V as bfloat16: so does the reference here.
    util = swap.original("tpu.paged_attention.util")
    dense = lambda p: _paged_dense(
        p.astype(jnp.bfloat16).astype(jnp.float32), page_indices)
    f = lambda q, kp: util.grouped_query_attention_reference(
        q, dense(kp), dense(v_pages), lengths)
    return jax.grad(functools.partial(loss, f), argnums=(0, 1))(q, k_pages)
  # K's cotangent passes through the bfloat16 cast: one bfloat16 ulp.
  return Case(run, reference, tol=1e-2)


def _splash_attention():
  q, k, v = (_rand(i, (2, 256, 128)) for i in range(3))

  def mask(m):
    return m.MultiHeadMask([m.CausalMask((256, 256))] * 2)

  def run(m, interpret):
    sizes = m.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    kernel = m.make_splash_mha_single_device(mask(m), block_sizes=sizes,
                                             interpret=interpret)
    return kernel(q, k, v)
  return Case(run, lambda m: m.make_masked_mha_reference(mask(m))(q, k, v))


def _ragged_paged_attention():
  # 2 sequences: a prefill of 5 tokens, a decode of 1; 8 KV pages of 16.
  q = _rand(0, (8, 4, 128))
  kv_pages = _rand(1, (8, 16, 4, 128))
  kv_lens = jnp.array([30, 17], jnp.int32)
  page_indices = jnp.array([[0, 3, 0, 0], [5, 2, 0, 0]], jnp.int32)
  cu_q_lens = jnp.array([0, 5, 6], jnp.int32)
  num_seqs = jnp.array([2], jnp.int32)
  args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)

  def run(m, _):
    return m.ragged_paged_attention(*args, num_kv_pages_per_block=2,
                                    num_queries_per_block=8)[:6]
  return Case(run, lambda m: m.ref_ragged_paged_attention(*args)[:6])


def _group_sizes():
  return jnp.array([96, 160], jnp.int32)


def _gmm():
  lhs, rhs = _rand(0, (256, 128)), _rand(1, (2, 128, 128))
  sizes = _group_sizes()

  def reference(m):
    rows = jnp.repeat(jnp.arange(2), sizes, total_repeat_length=256)
    return jnp.einsum("mk,mkn->mn", lhs, rhs[rows], precision="highest")
  return Case(lambda m, interpret: m.gmm(lhs, rhs, sizes,
                                         interpret=interpret),
              reference)


def _tgmm():
  lhs, rhs = _rand(0, (128, 256)), _rand(1, (256, 128))
  sizes = _group_sizes()

  def reference(m):
    rows = jnp.repeat(jnp.arange(2), sizes, total_repeat_length=256)
    onehot = (rows[:, None] == jnp.arange(2)).astype(jnp.float32)
    return jnp.einsum("km,mg,mn->gkn", lhs, onehot, rhs, precision="highest")
  return Case(lambda m, interpret: m.tgmm(lhs, rhs, sizes,
                                          interpret=interpret),
              reference)


def _threefry():
  key = jnp.array([3, 7], jnp.uint32)

  def reference(m):
    return jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"),
                           (8, 300), jnp.uint32)
  return Case(lambda m, _: m.plthreefry_random_bits(key, 32, (8, 300)),
              reference, tol=0)


def _philox():
  key = jnp.array([3, 7], jnp.uint32)
  return Case(lambda m, _: m.philox_random_bits(key, 32, (8, 300)), tol=0)


# --- GPU (Triton) ops -------------------------------------------------------

def _gpu_attention():
  q, k, v = (_rand(i, (1, 128, 2, 64)) for i in range(3))
  return Case(lambda m, interpret: m.mha(q, k, v, None, causal=True,
                                         interpret=interpret),
              lambda m: m.mha_reference(q, k, v, None, causal=True))


def _gpu_decode_attention():
  q = _rand(0, (2, 8, 64))
  k, v = (_rand(i, (2, 256, 2, 64)) for i in (1, 2))
  return Case(lambda m, interpret: m.gqa(q, k, v, block_h=16, block_k=64,
                                         k_splits=4, interpret=interpret),
              lambda m: m.gqa_reference(q, k, v))


def _gpu_paged_attention():
  q = _rand(0, (2, 8, 64))
  k_pages, v_pages = (_rand(i, (2, 8, 16, 64)) for i in (1, 2))
  tables = jnp.array([[7, 1, 4, 2], [0, 6, 3, 5]], jnp.int32)
  lengths = jnp.array([20, 50], jnp.int32)

  def reference(m):
    # [batch, kv_heads, seq, dim] -> [batch, seq, kv_heads, dim]
    dense = lambda p: _paged_dense(p, tables).swapaxes(1, 2)
    return m.paged_attention_reference(q, dense(k_pages), dense(v_pages),
                                       lengths)
  return Case(lambda m, interpret: m.paged_attention(
      q, k_pages, v_pages, tables, lengths, pages_per_compute_block=2,
      k_splits=2, interpret=interpret), reference)


def _gpu_norm(name):
  x = _rand(0, (2, 4, 256))      # [batch, seq, features]
  w, b = _rand(1, (256,)), _rand(2, (256,))
  return Case(lambda m, interpret: getattr(m, name)(x, w, b,
                                                    interpret=interpret),
              lambda m: getattr(m, f"{name}_reference")(x, w, b))


def _gpu_softmax():
  x = _rand(0, (8, 300))
  return Case(lambda m, interpret: m.softmax(x, interpret=interpret),
              lambda m: jax.nn.softmax(x, axis=-1))


# op -> (module of jax.experimental.pallas.ops, the case).
CASES: dict[str, tuple[str, Callable[[], Case]]] = {
    "tpu.matmul": ("tpu.matmul", _matmul),
    "tpu.example_kernel": ("tpu.example_kernel", _example_kernel),
    "tpu.all_gather": ("tpu.all_gather", _all_gather),
    "tpu.flash_attention": ("tpu.flash_attention", _flash_attention),
    "tpu.paged_attention": ("tpu.paged_attention", _paged_attention),
    "tpu.paged_attention (grad)": ("tpu.paged_attention",
                                   _paged_attention_grad),
    "tpu.splash_attention": ("tpu.splash_attention", _splash_attention),
    "tpu.ragged_paged_attention": ("tpu.ragged_paged_attention.kernel",
                                   _ragged_paged_attention),
    "tpu.megablox.gmm": ("tpu.megablox.gmm", _gmm),
    "tpu.megablox.tgmm": ("tpu.megablox.gmm", _tgmm),
    "tpu.random.threefry": ("tpu.random.threefry", _threefry),
    "tpu.random.philox": ("tpu.random.philox", _philox),
    "gpu.attention": ("gpu.attention", _gpu_attention),
    "gpu.decode_attention": ("gpu.decode_attention", _gpu_decode_attention),
    "gpu.paged_attention": ("gpu.paged_attention", _gpu_paged_attention),
    "gpu.layer_norm": ("gpu.layer_norm", lambda: _gpu_norm("layer_norm")),
    "gpu.rms_norm": ("gpu.rms_norm", lambda: _gpu_norm("rms_norm")),
    "gpu.softmax": ("gpu.softmax", _gpu_softmax),
}


def run_on_dsl(op: str, backend: str):
  module, make = CASES[op]
  case = make()
  with pl.default_backend(backend):
    return case, case.run(swap.swapped(module), False)


def run_on_pallas(op: str, case: Case):
  module = swap.original(CASES[op][0])
  force = (pallas_tpu.force_tpu_interpret_mode() if op.startswith("tpu.")
           else contextlib.nullcontext())
  with force:
    return case.run(module, True)


def close(got, want, tol, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, what
    if tol == 0:
      np.testing.assert_array_equal(g, w, err_msg=what)
    else:
      np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32),
                                 atol=tol, rtol=tol, err_msg=what)


if __name__ == "__main__":
  for op in sys.argv[1:] or CASES:
    for backend in swap.backends_of(op):
      t = time.time()
      try:
        case, got = run_on_dsl(op, backend)
        if case.reference is not None:
          close(got, case.reference(swap.swapped(CASES[op][0])),
                 case.ref_tol or case.tol, "reference")
        if op not in swap.NO_PALLAS:
          close(got, run_on_pallas(op, case), case.tol, "pallas")
        print(f"PASS {op} {backend} {time.time() - t:.1f}s", flush=True)
      except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"FAIL {op} {backend} {time.time() - t:.1f}s "
              f"{type(e).__name__}: {msg}", flush=True)
        if "-v" in sys.argv:
          traceback.print_exc()
