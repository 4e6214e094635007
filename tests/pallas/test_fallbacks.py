"""Math written once as lax operations (dsl.core.fallbacks) for the
backends without a rule: the functions against XLA's own, then kernels on
every CPU backend against jnp and Pallas's interpret mode, and the Mosaic
GPU lowering, which has no rule for any of them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl.core import backends, fallbacks
from tests.pallas import testing
from tests.pallas.mosaic_gpu_testing import gpu_module

# (no subnormals: XLA's CPU code and GPUs flush them)
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30,
                    1e-37, 1.0, -1.0, 0.5, -2.0, 3e38, -3e38], np.float32)

# name -> (lax function, operand count, arrays drawn for it)
OPS = {
    "erf_inv": (lax.erf_inv, 1, lambda r: r.uniform(-1, 1, 4096)),
    "cbrt": (lax.cbrt, 1, lambda r: r.standard_normal(4096) * 10.0 ** r.
             integers(-20, 20, 4096)),
    "atan": (lax.atan, 1, lambda r: r.standard_normal(4096) * 10.0 ** r.
             integers(-6, 6, 4096)),
    "atan2": (lax.atan2, 2, lambda r: r.standard_normal(4096) * 10.0 ** r.
              integers(-6, 6, 4096)),
    "log1p": (lax.log1p, 1, lambda r: np.concatenate([
        r.uniform(-1, 1, 2048) * 10.0 ** r.integers(-12, 0, 2048),
        r.uniform(-1, 1e6, 2048)])),
    "expm1": (lax.expm1, 1, lambda r: np.concatenate([
        r.uniform(-1, 1, 2048) * 10.0 ** r.integers(-12, 0, 2048),
        r.uniform(-100, 88, 2048)])),
    "sinh": (lax.sinh, 1, lambda r: np.concatenate([
        r.uniform(-1, 1, 2048) * 10.0 ** r.integers(-12, 0, 2048),
        r.uniform(-89, 89, 2048)])),
    "cosh": (lax.cosh, 1, lambda r: r.uniform(-89, 89, 4096)),
}
PRIMITIVE = {"erf_inv": lax.erf_inv_p, "cbrt": lax.cbrt_p,
             "atan": lax.atan_p, "atan2": lax.atan2_p, "log1p": lax.log1p_p,
             "expm1": lax.expm1_p, "sinh": lax.sinh_p, "cosh": lax.cosh_p}


def _operands(name, seed=0):
  _, arity, draw = OPS[name]
  r = np.random.default_rng(seed)
  xs = [np.concatenate([draw(r), SPECIAL]).astype(np.float32)
        for _ in range(arity)]
  if arity == 2:      # every pair of special values, signed zeros included
    a, b = np.meshgrid(SPECIAL, SPECIAL)
    xs = [np.concatenate([xs[0], a.ravel()]), np.concatenate([xs[1],
                                                              b.ravel()])]
  if name == "erf_inv":
    xs = [np.clip(xs[0], -1, 1)]
  return [jnp.asarray(x) for x in xs]


def _ulps(got, want):
  """Distance in float32 units in the last place (NaN = NaN, inf = inf)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  same = (got == want) | (np.isnan(got) & np.isnan(want))
  gi = got.view(np.int32).astype(np.int64)
  wi = want.view(np.int32).astype(np.int64)
  gi = np.where(gi < 0, -(gi & 0x7FFFFFFF), gi)
  wi = np.where(wi < 0, -(wi & 0x7FFFFFFF), wi)
  return np.where(same, 0, np.abs(gi - wi))


# name -> the exact function in float64 (numpy), where numpy has one
EXACT = {"cbrt": np.cbrt, "atan": np.arctan, "atan2": np.arctan2,
         "log1p": np.log1p, "expm1": np.expm1, "sinh": np.sinh,
         "cosh": np.cosh}
TINY = np.finfo(np.float32).tiny


def reference(name, xs):
  """The float32-rounded exact result (float64 numpy) where numpy has the
  function, else XLA's; results below the smallest normal float32 are
  flushed to a signed zero, as XLA's CPU code and GPUs flush them."""
  if name not in EXACT:
    return np.asarray(jax.jit(OPS[name][0])(*xs))
  with np.errstate(all="ignore"):
    want = EXACT[name](*[np.asarray(x, np.float64) for x in xs])
  want = np.where(np.abs(want) < TINY, np.copysign(0.0, want), want)
  return want.astype(np.float32)


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_fallback_is_within_a_few_ulps(name):
  xs = _operands(name)
  mine = np.asarray(jax.jit(fallbacks.FALLBACKS[PRIMITIVE[name]].fn)(*xs))
  mine = np.where(np.abs(mine) < TINY, np.copysign(0.0, mine), mine)
  want = reference(name, xs)
  ulps = _ulps(mine, want)
  worst = int(np.argmax(ulps))
  assert ulps.max() <= 4, (name, [float(x[worst]) for x in xs],
                           float(mine[worst]), float(want[worst]))
  # NaN where the reference has NaN, and the sign of every other result
  # (of zeros too)
  np.testing.assert_array_equal(np.isnan(mine), np.isnan(want))
  number = ~np.isnan(want)
  np.testing.assert_array_equal(np.signbit(mine)[number],
                                np.signbit(want)[number])


def test_a_backend_with_its_own_rule_keeps_it():
  mosaic = backends.rule_table("mosaic")
  triton = backends.rule_table("triton")
  assert not {lax.atan2_p, lax.cbrt_p, lax.expm1_p} & fallbacks.missing(
      mosaic)
  assert {lax.erf_inv_p, lax.atan2_p} <= fallbacks.missing(triton)
  gpu = fallbacks.missing(backends.rule_table("mosaic_gpu"))
  assert set(PRIMITIVE.values()) <= gpu


def test_float64_operands_keep_the_primitive():
  f64 = jax.core.ShapedArray((8,), np.float64)
  f32 = jax.core.ShapedArray((8,), np.float32)
  missing = frozenset({lax.erf_inv_p})
  assert fallbacks.applies(lax.erf_inv_p, [f32], missing)
  assert not fallbacks.applies(lax.erf_inv_p, [f64], missing)
  assert not fallbacks.applies(lax.erf_inv_p, [f32], frozenset())


def _kernel(name):
  fn, arity, _ = OPS[name]
  def kernel(*refs):
    refs, o_ref = refs[:arity], refs[arity]
    o_ref[...] = fn(*[r[...] for r in refs])
  return kernel


BACKENDS = ("triton_interpret", "mosaic_interpret")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(OPS))
def test_kernels_agree_with_jnp_and_pallas(name, dtype):
  fn, _, _ = OPS[name]
  xs = [x[:1024].reshape(8, 128).astype(dtype) for x in _operands(name)]
  out = jax.ShapeDtypeStruct((8, 128), dtype)
  names = BACKENDS if dtype != jnp.float16 else ("triton_interpret",)
  results = testing.run_backends(names, _kernel(name), out, *xs)
  wide = [x.astype(jnp.float32) for x in xs]
  want = np.asarray(jnp.asarray(reference(name, wide)).astype(dtype),
                    np.float32)
  for backend, got in results.items():
    got = np.asarray(got, np.float32)
    got = np.where(np.abs(got) < TINY, np.copysign(0.0, got), got)
    if dtype == jnp.float32:     # XLA's (Pallas's) own sinh, cosh: 24
      assert _ulps(got, want).max() <= (4 if backend != testing.PALLAS
                                        else 32), backend
    else:     # the float32 result rounded once, or its neighbour
      np.testing.assert_allclose(got, want, rtol=1e-2, atol=0,
                                 err_msg=backend)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want),
                                  err_msg=backend)


@pytest.mark.parametrize("name", sorted(OPS))
def test_mosaic_gpu_lowers_each_through_its_fallback(name):
  _, arity, _ = OPS[name]
  xs = [jnp.ones((128,), jnp.float32)] * arity
  f = pl.pallas_call(_kernel(name), jax.ShapeDtypeStruct((128,), jnp.float32),
                     backend="mosaic_gpu")
  module = str(gpu_module(f, *xs))
  assert name not in module.replace("atan2_fallback", "")
  assert "arith.divf" in module or "arith.mulf" in module


def test_a_refused_dtype_names_the_primitive_and_the_kernel():
  with jax.enable_x64(True):
    x = jnp.zeros((8,), jnp.float64)
    def atan2_kernel(x_ref, o_ref):
      o_ref[...] = lax.atan2(x_ref[...], x_ref[...])
    with pytest.raises(pl.BackendError) as e:
      jax.jit(pl.pallas_call(atan2_kernel,
                             jax.ShapeDtypeStruct((8,), jnp.float64),
                             backend="triton_interpret"))(x)
  msg = str(e.value)
  assert "primitive 'atan2'" in msg and "kernel 'atan2_kernel'" in msg
