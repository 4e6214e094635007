"""Shared helpers for the tests of kernels/ (tests/pallas/test_kernels_*.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import dsl as pl

# Few, reproducible examples: every new shape compiles a new XLA program.
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])

# Gradient checks compile a forward and a backward program per example.
GRAD_SETTINGS = settings(SETTINGS, max_examples=5)

DTYPES = (jnp.float32, jnp.bfloat16)

# Backends that run on CPU besides the default "interpret"; a kernel they
# cannot run (yet) is skipped, wrong values fail.
OTHER_CPU_BACKENDS = ("triton_interpret", "mosaic_interpret")


def tol(dtype, f32=1e-5, bf16=2e-2):
  return bf16 if jnp.dtype(dtype) == jnp.bfloat16 else f32


def assert_close(got, want, dtype=jnp.float32, f32=1e-5, bf16=2e-2):
  """|got - want| <= t * max(1, |want|_max), with t chosen by dtype."""
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, (got.shape, want.shape)
  t = tol(dtype, f32, bf16)
  scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
  err = float(np.max(np.abs(got - want))) if want.size else 0.0
  assert err <= t * scale, f"max error {err} > {t} * {scale}"


def assert_tree_close(got, want, dtype=jnp.float32, f32=1e-5, bf16=2e-2):
  got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_l) == len(want_l)
  for g, w in zip(got_l, want_l):
    assert_close(g, w, dtype, f32, bf16)


def rng(seed) -> np.random.Generator:
  return np.random.default_rng(abs(hash(seed)) % (1 << 32))


def normal(seed, shape, dtype, scale=1.0, shift=0.0):
  """Normal samples from numpy (no per-shape XLA compile, unlike jax.random)."""
  x = rng(seed).standard_normal(shape, np.float32) * scale + shift
  return jnp.asarray(x).astype(dtype)


def jitted(fn, **kw):
  """`fn` with keyword arguments bound, under jit (one compile, not one per
  eager op)."""
  return jax.jit(lambda *a: fn(*a, **kw))


def vjp_with(fn, args, cotangent):
  """The cotangents of `fn`'s differentiable args for output cotangent."""
  _, pullback = jax.vjp(fn, *args)
  return pullback(cotangent)


def automatic_vjp_or_xfail(fn, args, cotangent):
  """jax.vjp through a raw pallas_call (dsl's automatic reverse mode)."""
  try:
    return jax.jit(lambda *a: vjp_with(fn, a, cotangent))(*args)
  except NotImplementedError as e:
    pytest.xfail(f"automatic vjp not landed: {e}")


def run_or_skip(fn, *args):
  """Runs `fn` on a backend that may not support the kernel yet."""
  try:
    return jax.block_until_ready(fn(*args))
  except (pl.BackendError, NotImplementedError, ImportError) as e:
    pytest.skip(f"backend cannot run this kernel: {str(e).splitlines()[0]}")
  except pl.KernelError as e:
    pytest.skip(f"backend rejects this kernel: {str(e).splitlines()[0]}")
