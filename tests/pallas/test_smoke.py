"""The smoke set: a few minutes that say the library works on a JAX release.

`make test` runs the whole suite on the newest supported toolchain (.venv)
and this module alone on the oldest (.venv-oldest, constraints-oldest.txt):
the quickstart, one kernel on each CPU backend, grad and vmap through a
kernel, and the Mosaic and Triton code of the benchmark matmul."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from benchmarks.suite.matmul_bench import grid_k_kernel, loop_k_kernel
from dsl.core import jax_internals
from lowering_mosaic import to_mlir
from lowering_triton.aot import compile_aot, to_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
CPU_BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")


def test_the_installed_jax_is_supported():
  jax_internals.check_supported_jax()     # raises outside the range
  with pytest.raises(ImportError, match=r"jax and jaxlib >=0\.11\.2,<0\.13"):
    jax_internals.check_supported_jax("0.13.0", "0.13.0")
  with pytest.raises(ImportError, match="jaxlib 0.10.2"):
    jax_internals.check_supported_jax("0.11.2", "0.10.2")


def test_quickstart_runs():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "examples",
                                                   "quickstart.py")],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "matches jnp" in r.stdout


def _add(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + y_ref[...]


def _add_call(backend):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pl.pallas_call(_add, out_shape=jax.ShapeDtypeStruct((32, 128),
                                                             jnp.float32),
                        grid=(4,), in_specs=[spec, spec], out_specs=spec,
                        backend=backend)


def _inputs():
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128) / 100
  return x, jnp.cos(x)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_kernel_on_each_cpu_backend(backend):
  x, y = _inputs()
  got = jax.jit(_add_call(backend))(x, y)
  np.testing.assert_allclose(got, x * 2.0 + y, rtol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_and_vmap_through_a_kernel(backend):
  x, y = _inputs()
  call = _add_call(backend)
  dx, dy = jax.grad(lambda a, b: jnp.sum(call(a, b) ** 2), (0, 1))(x, y)
  want = 2 * (x * 2.0 + y)
  np.testing.assert_allclose(dx, 2 * want, rtol=1e-5)
  np.testing.assert_allclose(dy, want, rtol=1e-5)
  got = jax.vmap(call)(jnp.stack([x, y]), jnp.stack([y, x]))
  np.testing.assert_allclose(got[1], y * 2.0 + x, rtol=1e-6)


def _matmul_grid_k(m=256, k=256, n=256, b=128):
  return pl.pallas_call(
      grid_k_kernel(pl), out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // b, n // b, k // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((b, b), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((b, b), lambda i, j, kk: (i, j)))


def test_benchmark_matmul_mosaic_module():
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  text = to_mlir(_matmul_grid_k(), x, x)
  assert "tpu.matmul" in text
  assert "dimension_semantics" in text


def test_benchmark_matmul_triton_source_compiles_for_sm90():
  m = n = k = 256
  bm, bn, bk = 64, 64, 32
  call = pl.pallas_call(
      loop_k_kernel(pl, bk, k // bk),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float16),
      grid=(m // bm, n // bn),
      in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      backend="triton")
  x = jax.ShapeDtypeStruct((m, k), jnp.float16)
  (source,) = to_source(call, x, x)
  assert "tl.dot" in source
  (compiled,) = compile_aot(call, x, x, target="sm_90")
  stats = compiled.stats()
  assert not stats.spills
  assert stats.kernel.wgmma > 0        # 16-bit dots use Hopper's wgmma
