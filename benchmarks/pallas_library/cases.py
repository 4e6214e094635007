"""The cases of Pallas's kernel library run by import swap: one cheap shape
per op of `jax.experimental.pallas.ops` (served by `swap`), the matrix of
more shapes, dtypes, optional features and gradients (matrix_tpu.py,
matrix_gpu.py; tests run them under `-m slow`), how to run them on dsl and
on Pallas, and how to compare. Shared by tests/pallas/test_pallas_ops.py
(values), test_pallas_ops_golden.py (TPU modules) and the `pallas-ops`
benchmark suite.

    python -m benchmarks.pallas_library.cases [case ...]   # PASS/FAIL lines
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as pallas_mgpu
from jax.experimental.pallas import tpu as pallas_tpu

import dsl as pl
from lowering_mosaic import interpreter_options
from benchmarks.pallas_library import cases_mgpu, matrix_gpu, matrix_tpu, swap
from benchmarks.pallas_library.case import (NO_PALLAS_GRAD, Case, close,
                                            vjp_case)
from benchmarks.pallas_library.case import group_sizes as _group_sizes
from benchmarks.pallas_library.case import rand as _rand
from benchmarks.pallas_library.matrix_tpu import paged_dense as _paged_dense
from benchmarks.pallas_library.matrix_tpu import paged_pages as _paged_pages


# --- TPU ops ---------------------------------------------------------------
# Each case passes its arrays as `args` (the benchmark times the op as a
# function of them, so that XLA cannot fold it into a constant).

def _matmul():
  return Case(lambda m, _, x, y: m.matmul(x, y, block_shape=(128, 128),
                                          block_k=128),
              lambda m, x, y: jnp.dot(x, y, precision="highest"),
              args=(_rand(0, (256, 256)), _rand(1, (256, 256))))


def _example_kernel():
  return Case(lambda m, _, x: m.double(x), lambda m, x: 2 * x,
              args=(_rand(0, (8, 128)),))


def _all_gather():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  x = jax.device_put(_rand(0, (32, 128)),
                     jax.sharding.NamedSharding(mesh, jax.P("x")))
  return Case(lambda m, _, x: m.all_gather(x, mesh=mesh, axis_name="x"),
              lambda m, x: x, args=(x,))


def _flash_attention():
  sizes = dict(block_q=128, block_k_major=128, block_k=128, block_b=1)

  def run(m, _, q, k, v):
    return m.flash_attention(q, k, v, causal=True,
                             block_sizes=m.BlockSizes(**sizes))
  return Case(run, lambda m, q, k, v: m.mha_reference(q, k, v, None,
                                                      causal=True),
              args=tuple(_rand(i, (1, 2, 128, 128)) for i in range(3)))


def _paged_attention():
  q, k_pages, v_pages, lengths, page_indices = _paged_pages()

  def run(m, _, q, k_pages, v_pages):
    return m.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                             pages_per_compute_block=2)

  def reference(m, q, k_pages, v_pages):
    util = swap.original("tpu.paged_attention.util")
    return util.grouped_query_attention_reference(
        q, _paged_dense(k_pages, page_indices),
        _paged_dense(v_pages, page_indices), lengths)
  # Pallas's op differs from its reference by up to 1.4e-2 here (it reads K
  # and V as bfloat16; dsl and Pallas agree to 1e-5).
  return Case(run, reference, ref_tol=2e-2, args=(q, k_pages, v_pages))


def _paged_attention_grad():
  q, k_pages, v_pages, lengths, page_indices = _paged_pages()

  def op(m, _, q, k_pages):
    return m.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                             pages_per_compute_block=2)

  def reference(m, q, k_pages):
    # The kernel reads K and V as bfloat16: so does the reference here.
    util = swap.original("tpu.paged_attention.util")
    dense = lambda p: _paged_dense(
        p.astype(jnp.bfloat16).astype(jnp.float32), page_indices)
    return util.grouped_query_attention_reference(
        q, dense(k_pages), dense(v_pages), lengths)
  # K's cotangent passes through the bfloat16 cast: one bfloat16 ulp.
  return vjp_case(op, reference, (q, k_pages), (0, 1), tol=1e-2)


def _splash_attention():
  def mask(m):
    return m.MultiHeadMask([m.CausalMask((256, 256))] * 2)

  def run(m, interpret, q, k, v):
    sizes = m.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    kernel = m.make_splash_mha_single_device(mask(m), block_sizes=sizes,
                                             interpret=interpret)
    return kernel(q, k, v)
  return Case(run, lambda m, q, k, v: m.make_masked_mha_reference(mask(m))(
      q, k, v), args=tuple(_rand(i, (2, 256, 128)) for i in range(3)))


def _ragged_paged_attention():
  # 2 sequences: a prefill of 5 tokens, a decode of 1; 8 KV pages of 16.
  rest = (jnp.array([30, 17], jnp.int32),
          jnp.array([[0, 3, 0, 0], [5, 2, 0, 0]], jnp.int32),
          jnp.array([0, 5, 6], jnp.int32), jnp.array([2], jnp.int32))

  def run(m, _, q, kv_pages):
    return m.ragged_paged_attention(q, kv_pages, *rest,
                                    num_kv_pages_per_block=2,
                                    num_queries_per_block=8)[:6]
  return Case(run, lambda m, q, kv_pages: m.ref_ragged_paged_attention(
      q, kv_pages, *rest)[:6],
      args=(_rand(0, (8, 4, 128)), _rand(1, (8, 16, 4, 128))))


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


def _gmm_grad():
  """jax.grad through megablox's own custom_vjp (its backward pass is its
  gmm with the rhs transposed and its tgmm, both with traced grids)."""
  lhs, rhs = _rand(0, (256, 128)), _rand(1, (2, 128, 128))
  sizes = _group_sizes()

  def loss(f, lhs, rhs):
    return jnp.sum(f(lhs, rhs) ** 2)

  def run(m, interpret):
    f = lambda a, b: m.gmm(a, b, sizes, jnp.float32, (128, 128, 128), None,
                           None, False, interpret)
    return jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1)))(
        lhs, rhs)

  def reference(m):
    rows = jnp.repeat(jnp.arange(2), sizes, total_repeat_length=256)
    f = lambda a, b: jnp.einsum("mk,mkn->mn", a, b[rows],
                                precision="highest")
    return jax.grad(functools.partial(loss, f), argnums=(0, 1))(lhs, rhs)
  return Case(run, reference, tol=2e-2)


def _threefry():
  key = jnp.array([3, 7], jnp.uint32)

  def reference(m, key):
    return jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"),
                           (8, 300), jnp.uint32)
  return Case(lambda m, _, key: m.plthreefry_random_bits(key, 32, (8, 300)),
              reference, tol=0, args=(key,))


def _philox():
  return Case(lambda m, _, key: m.philox_random_bits(key, 32, (8, 300)),
              tol=0, args=(jnp.array([3, 7], jnp.uint32),))


# --- GPU (Triton) ops -------------------------------------------------------

def _gpu_attention():
  return Case(lambda m, interpret, q, k, v: m.mha(q, k, v, None, causal=True,
                                                  interpret=interpret),
              lambda m, q, k, v: m.mha_reference(q, k, v, None, causal=True),
              args=tuple(_rand(i, (1, 128, 2, 64)) for i in range(3)))


def _gpu_decode_attention():
  return Case(lambda m, interpret, q, k, v: m.gqa(
      q, k, v, block_h=16, block_k=64, k_splits=4, interpret=interpret),
      lambda m, q, k, v: m.gqa_reference(q, k, v),
      args=(_rand(0, (2, 8, 64)), _rand(1, (2, 256, 2, 64)),
            _rand(2, (2, 256, 2, 64))))


def _gpu_paged_attention():
  tables = jnp.array([[7, 1, 4, 2], [0, 6, 3, 5]], jnp.int32)
  lengths = jnp.array([20, 50], jnp.int32)

  def reference(m, q, k_pages, v_pages):
    # [batch, kv_heads, seq, dim] -> [batch, seq, kv_heads, dim]
    dense = lambda p: _paged_dense(p, tables).swapaxes(1, 2)
    return m.paged_attention_reference(q, dense(k_pages), dense(v_pages),
                                       lengths)
  return Case(lambda m, interpret, q, k_pages, v_pages: m.paged_attention(
      q, k_pages, v_pages, tables, lengths, pages_per_compute_block=2,
      k_splits=2, interpret=interpret), reference,
      args=(_rand(0, (2, 8, 64)), _rand(1, (2, 8, 16, 64)),
            _rand(2, (2, 8, 16, 64))))


def _gpu_norm(name):
  # [batch, seq, features], weight, bias
  return Case(lambda m, interpret, x, w, b: getattr(m, name)(
      x, w, b, interpret=interpret),
      lambda m, x, w, b: getattr(m, f"{name}_reference")(x, w, b),
      args=(_rand(0, (2, 4, 256)), _rand(1, (256,)), _rand(2, (256,))))


def _gpu_norm_grad(name):
  """The gradient through the op's custom_vjp: its backward kernels (dx,
  and dw/db over row blocks, which index rows and columns with arrays)."""
  def grad(f, x, w, b):
    return jax.grad(lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b))),
                    argnums=(0, 1, 2))(x, w, b)
  return Case(lambda m, interpret, *a: grad(functools.partial(
      getattr(m, name), interpret=interpret), *a),
      lambda m, *a: grad(getattr(m, f"{name}_reference"), *a),
      args=(_rand(0, (2, 4, 256)), _rand(1, (256,)), _rand(2, (256,))))


def _gpu_softmax():
  return Case(lambda m, interpret, x: m.softmax(x, interpret=interpret),
              lambda m, x: jax.nn.softmax(x, axis=-1),
              args=(_rand(0, (8, 300)),))


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
    "tpu.megablox.gmm (grad)": ("tpu.megablox.ops", _gmm_grad),
    "tpu.random.threefry": ("tpu.random.threefry", _threefry),
    "tpu.random.philox": ("tpu.random.philox", _philox),
    "gpu.attention": ("gpu.attention", _gpu_attention),
    "gpu.decode_attention": ("gpu.decode_attention", _gpu_decode_attention),
    "gpu.paged_attention": ("gpu.paged_attention", _gpu_paged_attention),
    "gpu.layer_norm": ("gpu.layer_norm", lambda: _gpu_norm("layer_norm")),
    "gpu.layer_norm (grad)": ("gpu.layer_norm",
                              lambda: _gpu_norm_grad("layer_norm")),
    "gpu.rms_norm": ("gpu.rms_norm", lambda: _gpu_norm("rms_norm")),
    "gpu.rms_norm (grad)": ("gpu.rms_norm",
                            lambda: _gpu_norm_grad("rms_norm")),
    "gpu.softmax": ("gpu.softmax", _gpu_softmax),
    **cases_mgpu.CASES,
}


# "op [variant]" -> (module, the case): every entry runs under -m slow.
MATRIX: dict[str, tuple[str, Callable[[], Case]]] = {
    **matrix_tpu.MATRIX, **matrix_gpu.MATRIX, **cases_mgpu.MATRIX}


def module_of(case_id: str) -> str:
  """The module of `jax.experimental.pallas.ops` a case (an op of CASES or
  a variant of MATRIX) runs."""
  return (CASES.get(case_id) or MATRIX[case_id])[0]


def make_case(case_id: str) -> Case:
  return (CASES.get(case_id) or MATRIX[case_id])[1]()


# "op [variant]" -> why it is compared with its reference only.
MATRIX_NO_PALLAS: dict[str, str] = {
    **matrix_tpu.NO_PALLAS, **matrix_gpu.NO_PALLAS}


def no_pallas(case_id: str) -> str | None:
  """Why the case is compared with its reference only (None: it is
  compared with Pallas's interpret mode too)."""
  return (MATRIX_NO_PALLAS.get(case_id)
          or swap.NO_PALLAS.get(swap.base_op(case_id)))


def golden_cases() -> list[str]:
  """The TPU cases (ops and variants) whose Mosaic modules dsl's lowering
  for a TPU must give as Pallas's own does (test_pallas_ops_golden.py):
  all but the gradients through dsl's automatic reverse mode, for which
  Pallas lowers nothing."""
  return [c for c in [*CASES, *MATRIX]
          if c.startswith("tpu.") and no_pallas(c) != NO_PALLAS_GRAD]


def num_cores(case_id: str) -> int:
  """The TensorCores per device the case's chip has (2: megacore)."""
  return matrix_tpu.NUM_CORES.get(case_id, 1)


@contextlib.contextmanager
def dsl_context(op: str, backend: str):
  """The context `op` runs in on dsl's `backend`: the backend, and on
  mosaic_interpret a chip of the case's cores."""
  with pl.default_backend(backend), interpreter_options(
      num_cores=num_cores(op)):
    yield


def run_on_dsl(op: str, backend: str):
  case = make_case(op)
  with dsl_context(op, backend):
    return case, case.run(swap.swapped(module_of(op)), False, *case.args)


# Pallas's GPU interpret mode, skipping the inline PTX of the Blackwell ops
# (fences and barriers that order one warpgroup's own operations, which it
# runs in order anyway): its documented way to run them.
_PALLAS_GPU_INTERPRET = pallas_mgpu.InterpretGPUParams(inline_mgpu="ignore")


def pallas_context(op: str):
  """The context Pallas's original of `op` runs in: its interpret mode
  forced where the op passes no `interpret` (TPU and Mosaic GPU ops), on a
  chip of the case's cores (TPU)."""
  return (pallas_tpu.force_tpu_interpret_mode(pallas_tpu.InterpretParams(
      num_cores_or_threads=num_cores(op))) if op.startswith("tpu.")
          else pallas_mgpu.force_gpu_interpret_mode(_PALLAS_GPU_INTERPRET)
          if swap.is_mgpu(op)
          else contextlib.nullcontext())


def run_on_pallas(op: str, case: Case):
  module = swap.original(module_of(op))
  with pallas_context(op):
    return case.run(module, True, *case.args)


def check(op: str, backend: str):
  """Runs case `op` on dsl's `backend` and compares it with its reference
  and with Pallas's interpret mode (AssertionError naming the comparison)."""
  case, got = run_on_dsl(op, backend)
  if case.reference is not None:
    want = case.reference(swap.original(module_of(op)), *case.args)
    close(got, want, case.ref_tol or case.tol,
          f"{op} on {backend} vs its reference")
  if no_pallas(op) is None:
    close(got, run_on_pallas(op, case), case.tol,
          f"{op} on {backend} vs Pallas's interpret mode")


if __name__ == "__main__":
  for op in [a for a in sys.argv[1:] if a != "-v"] or CASES:
    for backend in swap.backends_of(op):
      t = time.time()
      try:
        check(op, backend)
        print(f"PASS {op} {backend} {time.time() - t:.1f}s", flush=True)
      except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"FAIL {op} {backend} {time.time() - t:.1f}s "
              f"{type(e).__name__}: {msg}", flush=True)
        if "-v" in sys.argv:
          traceback.print_exc()
