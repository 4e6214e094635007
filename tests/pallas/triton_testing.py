"""Shared helpers for the tests of lowering_triton (tests/pallas/test_triton_*.py)."""
import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings

import dsl as pl
import lowering_triton
from dsl import backends

BACKEND = "triton_interpret"
ARCHS = ("sm_80", "sm_90")

# Triton's interpreter is slow: few examples, small shapes.
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def tol(dtype):
  return {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}.get(
      jnp.dtype(dtype), 1e-5)


def assert_close(got, want, dtype=jnp.float32, rtol=None):
  t = tol(dtype) if rtol is None else rtol
  np.testing.assert_allclose(np.asarray(jnp.asarray(got, jnp.float32)),
                             np.asarray(jnp.asarray(want, jnp.float32)),
                             rtol=t, atol=t)


def array(seed, shape, dtype, lo=-50, hi=50):
  r = np.random.default_rng(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(r.integers(lo, hi, shape)).astype(dtype)
  if dtype == jnp.bool_:
    return jnp.asarray(r.integers(0, 2, shape).astype(bool))
  return jnp.asarray(r.standard_normal(shape, np.float32)).astype(dtype)


# The backend `call` uses; the GPU tests switch it to "triton".
CURRENT = [BACKEND]


def call(kernel, out_shape, *args, backend=None, **kw):
  """pallas_call on the current Triton backend, under jit."""
  backend = backend or CURRENT[0]
  return jax.jit(lambda *a: pl.pallas_call(kernel, out_shape, backend=backend,
                                           **kw)(*a))(*args)


@contextlib.contextmanager
def default_backend(name=BACKEND, platform="cpu"):
  """Makes `name` the backend of every pallas_call with backend=None on
  `platform`, and records the kernels it lowered."""
  lowered = []
  old_default = backends.DEFAULT_FOR_PLATFORM[platform]
  rule = backends.lowering_rule(name, "<test>", None)

  def counting(ctx, *args, spec):
    lowered.append(spec)
    return rule(ctx, *args, spec=spec)

  backends.DEFAULT_FOR_PLATFORM[platform] = name
  backends.register_backend(name, counting)
  jax.clear_caches()
  try:
    yield lowered
  finally:
    backends.DEFAULT_FOR_PLATFORM[platform] = old_default
    backends.register_backend(name, rule)
    jax.clear_caches()


def parametrize_cases(fn):
  """The keyword arguments of every pytest.mark.parametrize case of `fn`."""
  axes = []
  for mark in getattr(fn, "pytestmark", []):
    if mark.name != "parametrize":
      continue
    names = [n.strip() for n in mark.args[0].split(",")]
    values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
    axes.append([dict(zip(names, v)) for v in values])
  for combo in itertools.product(*axes):
    kw = {}
    for part in combo:
      kw.update(part)
    yield kw


def case_id(name, kw) -> str:
  if not kw:
    return name
  return name + "[" + "-".join(getattr(v, "__name__", str(v))
                               for v in kw.values()) + "]"


def test_cases(module, skip=()):
  """(name, kwargs) pytest params for the test functions of `module`."""
  import inspect
  import pytest
  for name, fn in inspect.getmembers(module, inspect.isfunction):
    if not name.startswith("test_") or name in skip or \
        getattr(fn, "__test__", True) is False:
      continue
    if "capfd" in inspect.signature(fn).parameters:
      continue
    for kw in parametrize_cases(fn):
      yield pytest.param(name, kw, id=case_id(name, kw))


test_cases.__test__ = False   # a helper, not a test

__all__ = ["ARCHS", "BACKEND", "CURRENT", "SETTINGS", "array", "assert_close",
           "call", "default_backend", "lowering_triton", "parametrize_cases",
           "test_cases", "tol"]
