"""What one case of Pallas's kernel library on dsl is: how to run an op
(from its swapped copy on dsl, or from Pallas's original in its interpret
mode), its reference, and how close the results must be. Shared by the
cheap per-op cases (cases.py) and the matrix of shapes, dtypes, optional
features and gradients (matrix_tpu.py, matrix_gpu.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """One op: `run(module, interpret, *args)` calls it from `module` (swapped
  or Pallas's) on its arrays `args`, passing `interpret` where the op takes
  it; `reference(module, *args)` is the op's own reference (None: it has
  none). Arrays are arguments, not constants, so that the benchmark times
  the op rather than a result XLA folded."""
  run: Callable[..., Any]
  reference: Callable[..., Any] | None = None
  tol: float = 2e-3
  # Against the reference, where the op itself differs from it more.
  ref_tol: float | None = None
  args: tuple = ()


# Pallas's reverse mode needs a hand-written backward pass (a custom_vjp):
# grads of the ops without one run on dsl's automatic reverse mode only.
NO_PALLAS_GRAD = ("Pallas has no reverse mode through pallas_call (the op "
                  "has no custom_vjp)")


def rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def group_sizes():
  """The group sizes of the grouped (megablox, ragged dot) cases: 256 rows
  in two groups."""
  return jnp.array([96, 160], jnp.int32)


def vjp_case(op, reference, args, argnums, *, tol=2e-3,
             ref_tol=None) -> Case:
  """The cotangents of `args[argnums]` for a fixed random cotangent of the
  output: `op(module, interpret, *args)` against `reference(module,
  *args)`'s (the reference's own custom_vjp where it has one)."""
  fixed = list(args)

  def pulled(f, *primals, jit=True):
    def g(*diff):
      full = list(fixed)
      for k, d in zip(argnums, diff):
        full[k] = d
      return f(*full)

    def grads(*primals):
      out, pull = jax.vjp(g, *primals)
      return pull(jax.tree.map(lambda o: rand(99, o.shape, o.dtype), out))
    return (jax.jit(grads) if jit else grads)(*primals)

  # Some references read their integer operands in Python: not traced.
  return Case(
      lambda m, interpret, *p: pulled(lambda *a: op(m, interpret, *a), *p),
      lambda m, *p: pulled(lambda *a: reference(m, *a), *p, jit=False),
      tol=tol,
      ref_tol=ref_tol, args=tuple(args[k] for k in argnums))


def close(got, want, tol, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, what
    if tol == 0:
      np.testing.assert_array_equal(g, w, err_msg=what)
    else:
      np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32),
                                 atol=tol, rtol=tol, err_msg=what)
