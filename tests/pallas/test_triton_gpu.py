"""Backend "triton" on a CUDA GPU: the Triton-interpreter test suites again,
compiled by triton and launched through jaxlib's kernel-call custom call,
plus bf16 matmul/softmax/layer-norm kernels at realistic sizes.

Run on a GPU machine with `pytest -m gpu tests/pallas/test_triton_gpu.py`
(`make gpu-check` runs every GPU-marked test and the benchmarks).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
# The CPU suites' test functions, run again here on a GPU (backend "triton").
from tests.pallas import test_features as features
from tests.pallas import test_triton_ops as ops
from tests.pallas import testing
from tests.pallas.testing import assert_close, default_backend, test_cases


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _gpu_backend_and_exact_f32_dots():
  """`call` uses backend="triton"; f32 dots (kernel and jnp reference) use
  full f32 precision, as on the CPU."""
  old = testing.TRITON_BACKEND[0]
  testing.TRITON_BACKEND[0] = "triton"
  with jax.default_matmul_precision("float32"):
    yield
  testing.TRITON_BACKEND[0] = old


@pytest.mark.parametrize("name,kwargs", list(test_cases(
    features, backend="triton_interpret")))
def test_feature_kernels_on_gpu(name, kwargs):
  with default_backend("triton", platform="cuda") as lowered:
    getattr(features, name)(backend="triton", **kwargs)
  assert lowered


@pytest.mark.parametrize("name,kwargs", list(test_cases(
    ops, skip={"test_kernels_compile_ahead_of_time"})))
def test_ops_on_gpu(name, kwargs):
  getattr(ops, name)(**kwargs)


# ------------------------------------------------------------------ realistic kernels

def _matmul(x, y, bm=128, bn=128, bk=64, **kw):
  from benchmarks.gpu_triton import make_matmul
  return make_matmul(pl, bm=bm, bn=bn, bk=bk, **kw)(x, y)


@pytest.mark.parametrize("shape", [(512, 512, 512), (1024, 768, 256)])
def test_bf16_matmul(shape):
  m, k, n = shape
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16)
  y = jnp.asarray(r.standard_normal((k, n)), jnp.bfloat16)
  got = jax.jit(_matmul)(x, y)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  assert_close(got, want, jnp.bfloat16, tol=3e-2)


@pytest.mark.parametrize("rows,cols", [(512, 1024), (300, 1000)])
def test_softmax_and_layer_norm(rows, cols):
  from benchmarks.gpu_triton import make_layer_norm, make_softmax
  r = np.random.default_rng(1)
  x = jnp.asarray(r.standard_normal((rows, cols)), jnp.bfloat16)
  got = jax.jit(make_softmax(pl))(x)
  assert_close(got, jax.nn.softmax(x.astype(jnp.float32), -1), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal(cols), jnp.float32)
  b = jnp.asarray(r.standard_normal(cols), jnp.float32)
  got = jax.jit(make_layer_norm(pl))(x, w, b)
  xf = x.astype(jnp.float32)
  mu = xf.mean(-1, keepdims=True)
  want = (xf - mu) * jax.lax.rsqrt(((xf - mu) ** 2).mean(-1, keepdims=True)
                                   + 1e-5) * w + b
  assert_close(got, want, jnp.bfloat16, tol=5e-2)


def test_compile_cache_reuses_kernels():
  from lowering_triton import launch
  x = jnp.ones((256, 256), jnp.bfloat16)
  jax.block_until_ready(jax.jit(_matmul)(x, x))
  n = len(launch._KERNELS)
  jax.clear_caches()
  jax.block_until_ready(jax.jit(_matmul)(x, x))
  assert len(launch._KERNELS) == n


def test_runtime_assert_on_gpu():
  jax.config.update("jax_pallas_enable_runtime_assert", True)
  try:
    def kernel(x_ref, o_ref):
      pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
      o_ref[...] = x_ref[...]
    f = jax.jit(lambda x: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")(x))
    assert_close(f(jnp.ones(128)), jnp.ones(128))
  finally:
    jax.config.update("jax_pallas_enable_runtime_assert", False)
