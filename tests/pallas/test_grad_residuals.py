"""Derived backward kernels that read the outputs the forward saved
(dsl/transforms/residuals.py): where the tangent map of a grid point needs
only the blocks the point writes (a softmax whose jvp is written in its
result, `tanh`, `exp`), the transposed kernel reads the output instead of
recomputing it from the inputs, and does not read those inputs at all;
a row statistic the forward saves (a norm's 1/rms, mean) is read where
recomputing it would take a reduction, though the inputs are read for
other residuals."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.inspection import traced_kernel_calls, traced_kernels
from dsl.transforms import residuals
from tests.pallas.testing import CPU_BACKENDS

sm = importlib.import_module("kernels.softmax")
rn = importlib.import_module("kernels.rms_norm")
ln = importlib.import_module("kernels.layer_norm")


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


def _forward_spec(f, *args):
  (spec, _), = traced_kernels(f, *args)
  return spec


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rows", [256, 200])   # 200: a partial edge block
def test_a_saved_row_statistic_is_read_not_recomputed(backend, rows):
  """RMS norm's forward saves each row's 1/rms: the backward still reads x
  and the weight (its tangent map needs them) and reads the saved 1/rms
  rather than its reduction over x, where the statistic's blocks lie
  inside its array; with a partial edge block it recomputes it."""
  x, w, ct = _data((rows, 128), (128,), (rows, 128))
  # blocks of 128 rows: a TPU tiles the saved (rows,) statistic by 128
  f = lambda x, w: rn.forward(x, w, eps=1e-6, backend=backend,
                              block_rows=128)[0]
  _check_grads(f, rn.reference, (x, w), ct)
  so = residuals.saved_outputs(_forward_spec(f, x, w))
  if rows % 128:
    assert so is None
  else:
    assert so.outputs == (1,) and so.reads == (True, True)
  assert _transposed_operands(f, x, w) == {"rms_norm_fwd_transpose": (0, 1)}


def _scaled_by_row_sum(x, w):
  """`x * w / s` per row, saving the row statistic `s = sum(x**2) + 1`."""
  def kernel(x_ref, w_ref, y_ref, s_ref):
    v = x_ref[...]
    s = jnp.sum(v * v, axis=1, keepdims=True) + 1.0
    y_ref[...] = v * w_ref[...][None, :] / s
    s_ref[...] = s[:, 0]
  return pl.pallas_call(
      kernel, (jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct(x.shape[:1], x.dtype)),
      grid=(pl.cdiv(x.shape[0], 8),),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)),
                pl.BlockSpec((128,), lambda i: (0,))],
      out_specs=(pl.BlockSpec((8, 128), lambda i: (i, 0)),
                 pl.BlockSpec((8,), lambda i: (i,))),
      backend="interpret", name="scaled")(x, w)[0]


@pytest.mark.parametrize("rows", [24, 20])
def test_a_statistic_divided_by_is_read_only_inside_its_array(rows):
  """The weight's cotangent sums over every row, the edge block's rows
  past the array too: a saved `s` read as 0 there would give `0 / 0`;
  recomputed from the zeros of x there, it is 1."""
  x, w, ct = _data((rows, 128), (128,), (rows, 128))
  want = lambda x, w: x * w / (jnp.sum(x * x, axis=1, keepdims=True) + 1.0)
  _check_grads(_scaled_by_row_sum, want, (x, w), ct)
  so = residuals.saved_outputs(_forward_spec(_scaled_by_row_sum, x, w))
  assert (so is not None) == (rows % 8 == 0)


def test_layer_norm_reads_its_saved_mean_and_rstd():
  x, w, b, ct = _data((24, 128), (128,), (128,), (24, 128))
  f = lambda x, w, b: ln.forward(x, w, b, eps=1e-5, backend="interpret",
                                 block_rows=8)[0]
  _check_grads(f, ln.reference, (x, w, b), ct)
  so = residuals.saved_outputs(_forward_spec(f, x, w, b))
  assert so is not None and so.outputs == (1, 2)


def _rms_saving(stat_dtype):
  """RMS norm (no weight) saving its 1/rms in `stat_dtype`."""
  def f(x):
    def kernel(x_ref, y_ref, r_ref):
      v = x_ref[...]
      r = jax.lax.rsqrt(jnp.mean(v * v, axis=1, keepdims=True) + 1e-6)
      y_ref[...] = v * r
      r_ref[...] = r[:, 0].astype(r_ref.dtype)
    return pl.pallas_call(
        kernel, (jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(x.shape[:1], stat_dtype)),
        grid=(pl.cdiv(x.shape[0], 8),),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((8, 128), lambda i: (i, 0)),
                   pl.BlockSpec((8,), lambda i: (i,))),
        backend="interpret", name="rms_saving")(x)[0]
  return f


@pytest.mark.parametrize("stat_dtype,read", [(jnp.float32, True),
                                             (jnp.bfloat16, False)])
def test_a_statistic_saved_in_a_narrower_dtype_is_not_read(stat_dtype, read):
  """Saved in bfloat16, the statistic is not the value the tangent map
  needs: the backward recomputes it from x (and its gradient stays the
  float32 one)."""
  x, ct = _data((24, 128), (24, 128))
  f = _rms_saving(stat_dtype)
  _check_grads(f, lambda x: rn.reference(x, None), (x,), ct)
  assert (residuals.saved_outputs(_forward_spec(f, x)) is not None) == read
