"""Derived backward kernels that read the outputs the forward saved
(dsl/transforms/residuals.py): where the tangent map of a grid point needs
only the blocks the point writes (a softmax whose jvp is written in its
result, `tanh`, `exp`), the transposed kernel reads the output instead of
recomputing it from the inputs, and does not read those inputs at all."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.inspection import traced_kernel_calls
from tests.pallas.testing import CPU_BACKENDS

sm = importlib.import_module("kernels.softmax")


def _data(*shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _rowwise(fn, backend, out_dtype=None, rows=8):
  """`fn` of each (rows, 128) block of a (n, 128) array, one block per
  grid point."""
  def f(x, *ws):
    def kernel(x_ref, *refs):
      *w_refs, o_ref = refs
      o_ref[...] = fn(x_ref[...], *[w[...] for w in w_refs]).astype(
          o_ref.dtype)
    spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, out_dtype or x.dtype),
        grid=(pl.cdiv(x.shape[0], rows),), in_specs=[spec] * (1 + len(ws)),
        out_specs=spec, backend=backend, name="rowwise")(x, *ws)
  return f


def _transposed_operands(f, *args):
  """The argument positions of `f`'s gradient each backward kernel reads
  (the forward kernels left out), by kernel name."""
  g = jax.grad(lambda *a: jnp.sum(f(*a)), tuple(range(len(args))))
  return {c.spec.name: c.reads_inputs for c in traced_kernel_calls(g, *args)
          if c.spec.name.endswith("_transpose")}


def _check_grads(f, want, args, ct):
  got = jax.grad(lambda *a: jnp.sum(f(*a) * ct), tuple(range(len(args))))(
      *args)
  exp = jax.grad(lambda *a: jnp.sum(want(*a) * ct), tuple(range(len(args))))(
      *args)
  for g, w in zip(got, exp):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rows", [16, 20])     # 20: a partial edge block
def test_softmax_backward_reads_the_saved_output_not_x(backend, rows):
  """The saved output's positions past the array count as zeros."""
  x, ct = _data((rows, 128), (rows, 128))
  f = lambda x: sm.softmax_2d(x, backend=backend, block_rows=8)
  _check_grads(f, sm.reference, (x,), ct)
  # The transposed kernel reads no input of the gradient: its operands are
  # the saved output and the cotangent.
  assert _transposed_operands(f, x) == {"softmax_fused_transpose": ()}
  g = jax.grad(lambda x: jnp.sum(f(x) * ct))
  passes = [c for c in traced_kernel_calls(g, x) if c.reads_inputs]
  assert [c.spec.name for c in passes] == ["softmax_fused"]


@pytest.mark.parametrize("fn,want", [
    (jnp.tanh, jnp.tanh), (jnp.exp, jnp.exp),
    (jax.nn.sigmoid, jax.nn.sigmoid)])
def test_functions_whose_jvp_reads_their_result_read_the_output(fn, want):
  x, ct = _data((24, 128), (24, 128))
  f = _rowwise(fn, "interpret")
  _check_grads(f, want, (x,), ct)
  assert _transposed_operands(f, x) == {"rowwise_transpose": ()}


def test_inputs_still_needed_are_read_and_others_are_not():
  """tanh(x) * w: the product's tangent needs w and tanh(x) (not the
  output): both inputs are read."""
  x, w, ct = _data((16, 128), (16, 128), (16, 128))
  f = _rowwise(lambda x, w: jnp.tanh(x) * w, "interpret")
  _check_grads(f, lambda x, w: jnp.tanh(x) * w, (x, w), ct)
  assert _transposed_operands(f, x, w) == {"rowwise_transpose": (0, 1)}


def test_an_output_stored_in_another_dtype_is_not_read():
  """The output is the result rounded to bfloat16: reading it would change
  the gradient, so the backward recomputes from x."""
  (x,) = _data((16, 128))
  f = _rowwise(jnp.tanh, "interpret", out_dtype=jnp.bfloat16)
  assert _transposed_operands(f, x) == {"rowwise_transpose": (0,)}


def test_linearize_runs_the_linear_kernel_with_the_saved_output():
  x, dx = _data((16, 128), (16, 128))
  f = lambda x: sm.softmax_2d(x, backend="interpret", block_rows=8)
  y, f_jvp = jax.linearize(f, x)
  want_y, want_dy = jax.jvp(sm.reference, (x,), (dx,))
  np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(f_jvp(dx), want_dy, rtol=1e-5, atol=1e-6)
