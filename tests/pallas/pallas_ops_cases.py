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
from jax.experimental.pallas import mosaic_gpu as pallas_mgpu
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
    util = swap.original("tpu.paged_attention.util")
    f = lambda q, kp: util.grouped_query_attention_reference(
        q, _paged_dense(kp, page_indices),
        _paged_dense(v_pages, page_indices), lengths)
    return jax.grad(functools.partial(loss, f), argnums=(0, 1))(q, k_pages)
  return Case(run, reference, tol=2e-2)


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


def _gpu_norm_grad(name):
  """The gradient through the op's custom_vjp: its backward kernels (dx,
  and dw/db over row blocks, which index rows and columns with arrays)."""
  x = _rand(0, (2, 4, 256))
  w, b = _rand(1, (256,)), _rand(2, (256,))

  def grad(f):
    return jax.grad(lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b))),
                    argnums=(0, 1, 2))(x, w, b)
  return Case(lambda m, interpret: grad(functools.partial(
      getattr(m, name), interpret=interpret)),
      lambda m: grad(getattr(m, f"{name}_reference")))


def _gpu_softmax():
  x = _rand(0, (8, 300))
  return Case(lambda m, interpret: m.softmax(x, interpret=interpret),
              lambda m: jax.nn.softmax(x, axis=-1))


# --- GPU (Mosaic GPU, plgpu) ops --------------------------------------------

class _SimulatedGpu:
  """What the `*_mgpu` ops ask of the GPU they run on, answered on a CPU:
  the default device has 2 SMs (so persistent kernels launch 2 blocks, which
  keeps the CPU run short) and the CUDA runtime is 13.0."""

  core_count = 2

  def get_default_device(self):
    return self

  def cuda_runtime_get_version(self):
    return 13000


_GPU = _SimulatedGpu()


@contextlib.contextmanager
def simulated_gpu(module):
  """Points `module`'s `backend` and `cuda_versions` (where it has them) at
  `_GPU` while the op runs; the op's source is unchanged."""
  saved = {name: getattr(module, name) for name in ("backend", "cuda_versions")
           if hasattr(module, name)}
  for name in saved:
    setattr(module, name, _GPU)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(module, name, value)


def _on_gpu(run):
  """`run(m, interpret)` with `m` on the simulated GPU."""
  def wrapped(m, interpret):
    with simulated_gpu(m):
      return run(m, interpret)
  return wrapped


def _f16(seed, shape):
  return _rand(seed, shape, jnp.float16)


def _hopper_matmul():
  a, b = _f16(0, (128, 128)), _f16(1, (128, 128))

  def run(m, _):
    config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                            max_concurrent_steps=2)
    return m.matmul(a, b, None, config)
  return Case(_on_gpu(run), lambda m: jnp.dot(
      a, b, preferred_element_type=jnp.float32).astype(jnp.float16),
      tol=2e-2)


def _hopper_mixed_type_matmul():
  a = jax.random.randint(jax.random.key(0), (128, 128), -128, 127, jnp.int8)
  b = _rand(1, (128, 128), jnp.bfloat16)

  def run(m, _):
    config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                            max_concurrent_steps=2)
    return m.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=config)
  return Case(_on_gpu(run),
              lambda m: m.reference(a, b, out_dtype=jnp.bfloat16), tol=2e-2)


def _attention_mgpu(causal):
  q, k, v = (_f16(i, (1, 256, 1, 64)) for i in range(3))

  def run(m, _):
    config = m.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                            causal=causal)
    return m.attention(q, k, v, config)
  return Case(_on_gpu(run),
              lambda m: m.attention_reference(q, k, v, causal=causal),
              tol=5e-3)


def _ragged_dot_mgpu():
  lhs, rhs = _f16(0, (256, 128)), _f16(1, (2, 128, 128))
  sizes = _group_sizes()

  def run(m, _):
    return m.ragged_dot(lhs, rhs, group_sizes=sizes, block_m=64, block_n=64,
                        block_k=64, max_concurrent_steps=2, grid_block_n=1)
  return Case(_on_gpu(run), lambda m: jax.lax.ragged_dot(
      lhs, rhs, sizes, preferred_element_type=jnp.float32).astype(
          jnp.float16), tol=2e-2)


def _transposed_ragged_dot_mgpu():
  lhs, rhs = _f16(0, (256, 128)), _f16(1, (256, 128))
  sizes = _group_sizes()

  def run(m, _):
    return m.transposed_ragged_dot(lhs, rhs, group_sizes=sizes, block_m=64,
                                   block_n=64, block_k=64,
                                   max_concurrent_steps=2, grid_block_n=1)
  return Case(_on_gpu(run), lambda m: m.ref_transposed_ragged_dot(
      lhs, rhs, sizes), tol=2e-2)


def _on_devices(fn, x, out_spec):
  """`fn` per device of a mesh over the CPU devices, `x` split along x."""
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("x")))
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("x"),
                               out_specs=out_spec, check_vma=False))(x)


def _all_gather_mgpu():
  x = _rand(0, (8 * 16, 128))

  def run(m, _):
    return _on_devices(lambda s: m.all_gather(s, axis_name="x", num_blocks=2),
                       x, jax.P())
  return Case(_on_gpu(run), lambda m: x)


def _reduce_scatter_mgpu():
  x = _rand(0, (8 * 64, 128))

  def run(m, _):
    return _on_devices(lambda s: m.reduce_scatter(
        s, axis_name="x", scatter_dimension=0, num_blocks=2), x, jax.P("x"))
  return Case(_on_gpu(run), lambda m: x.reshape(8, 64, 128).sum(0))


def _collective_matmul_mgpu():
  lhs, rhs = _f16(0, (8 * 64, 128)), _f16(1, (128, 128))

  def run(m, _):
    config = m.hopper_matmul_mgpu.TuningConfig(
        tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    return _on_devices(lambda s: m.all_gather_lhs_matmul(
        s, rhs, "x", config=config), lhs, jax.P())
  return Case(_on_gpu(run), lambda m: jnp.dot(lhs, rhs))


def _blackwell_matmul_mgpu():
  a, b = _f16(0, (256, 256)), _f16(1, (256, 256))

  def run(m, _):
    config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                            max_concurrent_steps=2, collective=False)
    return m.matmul_kernel(a, b, config)
  return Case(_on_gpu(run), lambda m: jnp.dot(a, b))


def _blackwell_ragged_dot_mgpu():
  a, b = _f16(0, (256, 256)), _f16(1, (2, 256, 256))
  sizes = jnp.array([128, 128], jnp.int32)

  def run(m, _):
    config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                            max_concurrent_steps=2, collective=False,
                            grid_tile_width=1,
                            grid_minor_dim=m.blackwell_matmul_mgpu.
                            MatmulDimension.N)
    return m.ragged_dot_kernel(a, b, sizes, config)
  return Case(_on_gpu(run), lambda m: m.ragged_dot_reference(a, b, sizes))


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
    "gpu.hopper_matmul_mgpu": ("gpu.hopper_matmul_mgpu", _hopper_matmul),
    "gpu.hopper_mixed_type_matmul_mgpu": ("gpu.hopper_mixed_type_matmul_mgpu",
                                          _hopper_mixed_type_matmul),
    "gpu.attention_mgpu": ("gpu.attention_mgpu",
                           lambda: _attention_mgpu(False)),
    "gpu.attention_mgpu (causal)": ("gpu.attention_mgpu",
                                    lambda: _attention_mgpu(True)),
    "gpu.ragged_dot_mgpu": ("gpu.ragged_dot_mgpu", _ragged_dot_mgpu),
    "gpu.transposed_ragged_dot_mgpu": ("gpu.transposed_ragged_dot_mgpu",
                                       _transposed_ragged_dot_mgpu),
    "gpu.collective_matmul_mgpu": ("gpu.collective_matmul_mgpu",
                                   _collective_matmul_mgpu),
    "gpu.reduce_scatter_mgpu": ("gpu.reduce_scatter_mgpu",
                                _reduce_scatter_mgpu),
    "gpu.all_gather_mgpu": ("gpu.all_gather_mgpu", _all_gather_mgpu),
    "gpu.blackwell_matmul_mgpu": ("gpu.blackwell_matmul_mgpu",
                                  _blackwell_matmul_mgpu),
    "gpu.blackwell_ragged_dot_mgpu": ("gpu.blackwell_ragged_dot_mgpu",
                                      _blackwell_ragged_dot_mgpu),
}


def run_on_dsl(op: str, backend: str):
  module, make = CASES[op]
  case = make()
  with pl.default_backend(backend):
    return case, case.run(swap.swapped(module), False)


def run_on_pallas(op: str, case: Case):
  module = swap.original(CASES[op][0])
  force = (pallas_tpu.force_tpu_interpret_mode() if op.startswith("tpu.")
           else pallas_mgpu.force_gpu_interpret_mode() if swap.is_mgpu(op)
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
