"""check_grads (order 1, forward and reverse) on every CPU backend for a
corpus of kernels (grad_corpus.py): the forward kernels of `kernels/` called without their
hand-written backward passes, and the patterns derived kernels must carry
(scratch accumulators with a `pl.when` init, row loops, `cond`, masked
loads/stores, aliases, scalar prefetch).

Each case is checked three ways: its outputs against a jnp reference,
`jax.test_util.check_grads` against finite differences, and its jvp and vjp
(with a fixed cotangent) against those of the reference. Shapes are the
smallest TPU-legal ones (8 x 128 float32 tiles) so that `mosaic_interpret`
runs every case the others run.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl import triton as plt
from tests.pallas.grad_corpus import CASES, SLOW_CASES
from tests.pallas.testing import CPU_BACKENDS
from tests.pallas.testing import check_values_and_grads as _check
from tests.pallas.testing import uniform_arrays as _data


def _one_backend_per_case(cases):
  """(case, backend) params: the default suite runs each case on one CPU
  backend, in turn, so every backend gets its share; `-m slow` adds the
  others."""
  for i, case in enumerate(cases):
    for j, backend in enumerate(CPU_BACKENDS):
      marks = [] if j == i % len(CPU_BACKENDS) else [pytest.mark.slow]
      yield pytest.param(case, backend, marks=marks, id=f"{case}-{backend}")


@pytest.mark.parametrize("case,backend",
                         list(_one_backend_per_case(sorted(CASES))))
def test_check_grads(case, backend):
  _check(*CASES[case](backend))


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_check_grads_slow(case, backend):
  _check(*SLOW_CASES[case](backend))


# ------------------------------------- masked loads and stores (Triton-style)

def _masked_kernel(x_ref, init_ref, o_ref, *, n):
  cols = lax.broadcasted_iota(jnp.int32, (8, 128), 1)
  mask = cols < n
  x = plt.load(x_ref, mask=mask, other=0.0)
  plt.store(o_ref, jnp.exp(x) * x, mask=mask)


# A TPU never reads an output block in, so a masked store leaves stale data
# in the lanes it skips there: this kernel relies on the output being
# written in place, as on GPUs and the host backends that model them.
@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_check_grads_masked_load_store(backend):
  """Lanes past `n` are neither read nor written: their output keeps its
  initial contents (the aliased input), so their gradient is the identity."""
  x, init = _data((8, 128), (8, 128))
  n = 100
  kernel = functools.partial(_masked_kernel, n=n)

  def f(x, init):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          input_output_aliases={1: 0}, backend=backend)(x, init)

  def want(x, init):
    keep = jnp.arange(128) < n
    return jnp.where(keep, jnp.exp(x) * x, init)
  _check(f, want, (x, init))


def _masked_rows_kernel(x_ref, w_ref, init_ref, o_ref, *, n):
  rows = (lax.broadcasted_iota(jnp.int32, (8, 128), 0) < n)
  x = plt.load(x_ref, mask=rows)            # no `other`: rows >= n unspecified
  plt.store(o_ref, jnp.dot(x, w_ref[...], precision="highest"), mask=rows)


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_grad_through_a_masked_load_without_other(backend):
  """Rows past `n` are read from unspecified memory (poison on the CPU) and
  never stored: their cotangent is 0, and the weight's gradient sums only the
  rows that exist (poison must not reach it as 0 * NaN)."""
  x, w, init = _data((8, 128), (128, 128), (8, 128))
  n = 5
  kernel = functools.partial(_masked_rows_kernel, n=n)

  def f(x, w, init):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          input_output_aliases={2: 0}, backend=backend)(
                              x, w, init)

  def want(x, w, init):
    keep = (jnp.arange(8) < n)[:, None]
    return jnp.where(keep, jnp.dot(x, w, precision="highest"), init)
  _check(f, want, (x, w, init))


# ------------------------------------------------------------ vmap

@pytest.mark.parametrize("case,backend", list(_one_backend_per_case(
    ["scratch_accumulator", "fori_loop_rows", "scalar_prefetch",
     "layer_norm"])))
def test_vmap_and_grad_of_vmap(case, backend):
  """A batch of two: the batched kernel (a new leading grid dim, or one call
  per element with scalar prefetch) and its gradient, per element."""
  f, want, args = CASES[case](backend)
  batch = [jnp.stack([a, a[::-1] * 0.5]) for a in args]
  got = jax.vmap(f)(*batch)
  for b in range(2):
    want_b = want(*[x[b] for x in batch])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_b)):
      np.testing.assert_allclose(g[b], w, rtol=1e-4, atol=1e-4)
  loss = lambda fn: (lambda *xs: sum(jnp.sum(o ** 2) for o in
                                     jax.tree.leaves(jax.vmap(fn)(*xs))))
  for g, w in zip(jax.grad(loss(f), tuple(range(len(batch))))(*batch),
                  jax.grad(loss(want), tuple(range(len(batch))))(*batch)):
    np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
