"""The interpret backend's fast paths keep every result: `Element` blocks
whose offsets step with a grid axis are cut from shifted slices of the
padded array (no gather), and a scan over a long sequential grid carries
its state as a slice of the array (no transposes, no index arithmetic but
the loop counter). Each kernel is checked against a plain numpy/jnp
reference and Pallas's interpret mode."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.grid_plan import MAX_WINDOW_SLICES, make_plan
from dsl.core.inspection import kernel_specs


def _plan(f, *args):
  [(spec, _)] = list(kernel_specs(jax.make_jaxpr(f)(*args).jaxpr))
  return make_plan(spec.grid_mapping, spec.compiler_params, spec.jaxpr)


def _lowered(f, *args) -> str:
  return jax.jit(f).lower(*args).as_text()


def _windows_np(x, start, step, count, size, pad):
  """Window g of the 1-D `x` at element offset `start + step * g` into x
  padded with (pad[0], pad[1] + size) NaNs, as the backend pads it."""
  xp = np.concatenate([np.full(pad[0], np.nan), np.asarray(x, np.float64),
                       np.full(pad[1] + size, np.nan)])
  return np.stack([xp[start + step * g:start + step * g + size]
                   for g in range(count)])


# ------------------------------------------------------ windows of 1-D arrays

def _copy_windows(m, size, pad, index_map, count, **kw):
  """Copies each window (an Element block) into one output row."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  return m.pallas_call(
      kernel, jax.ShapeDtypeStruct((count, size), jnp.float32), grid=(count,),
      in_specs=[m.BlockSpec((m.Element(size, pad),), index_map)],
      out_specs=m.BlockSpec((None, size), lambda i: (i, 0)), **kw)


# (size, padding, step, start, count): overlapping windows reaching into
# both paddings, windows with gaps, one window at every point, and steps
# small enough that a window is many slices.
WINDOWS = [
    (12, (3, 5), 8, 0, 4),     # overlap 4; first and last reach the padding
    (12, (3, 5), 8, 1, 4),
    (5, (0, 0), 7, 2, 4),      # gaps between windows
    (10, (2, 2), 3, 0, 9),     # 4 slices per window
    (12, (3, 5), 0, 6, 3),     # the same window at every point
]


@pytest.mark.parametrize("size,pad,step,start,count", WINDOWS)
def test_windows_past_both_ends_read_poison(size, pad, step, start, count):
  x = jnp.arange(1, 31, dtype=jnp.float32)
  imap = lambda i: (start + step * i,)
  f = _copy_windows(pl, size, pad, imap, count, backend="interpret")
  plan = _plan(f, x)
  assert plan.operands[0].mode == "view"
  assert plan.operands[0].windows == ((start, step),)
  got = jax.jit(f)(x)
  np.testing.assert_array_equal(
      got, _windows_np(x, start, step, count, size, pad))
  theirs = _copy_windows(jpl, size, pad, imap, count, interpret=True)(x)
  np.testing.assert_array_equal(got, theirs)


def test_a_window_past_the_padded_array_reads_poison_there():
  """The offsets 28 and 36 are legal (inside the 38 padded elements), but
  their windows run 2 and 10 elements past them: those read poison, as on
  the gather path (Pallas's interpret mode clamps the window instead)."""
  x = jnp.arange(1, 31, dtype=jnp.float32)
  imap = lambda i: (4 + 8 * i,)
  f = _copy_windows(pl, 12, (3, 5), imap, 5, backend="interpret")
  assert _plan(f, x).operands[0].windows == ((4, 8),)
  got = np.asarray(jax.jit(f)(x))
  np.testing.assert_array_equal(got, _windows_np(x, 4, 8, 5, 12, (3, 5)))
  np.testing.assert_array_equal(got[3, :5], [26., 27., 28., 29., 30.])
  assert np.isnan(got[3, 5:]).all() and np.isnan(got[4]).all()


@pytest.mark.parametrize("index_map,why", [
    (lambda i: (i * i,), "offsets not affine in the grid index"),
    (lambda i: (i,), "a window of more slices than the limit"),
])
def test_other_element_windows_are_gathered_with_the_same_results(index_map,
                                                                  why):
  x = jnp.arange(1, 31, dtype=jnp.float32)
  size = MAX_WINDOW_SLICES + 1 if "slices" in why else 4
  f = _copy_windows(pl, size, (0, 0), index_map, 5, backend="interpret")
  assert _plan(f, x).operands[0].mode == "gather", why
  starts = [int(index_map(i)[0]) for i in range(5)]
  want = np.stack([_windows_np(x, s, 0, 1, size, (0, 0))[0] for s in starts])
  got = jax.jit(f)(x)
  np.testing.assert_array_equal(got, want)
  theirs = _copy_windows(jpl, size, (0, 0), index_map, 5,
                         interpret=True)(x)
  np.testing.assert_array_equal(got, theirs)


# -------------------------------------------- a halo convolution, 1-D and 2-D

TAPS, HALO = 5, 2


def _conv(m, x, w, rows, **kw):
  """Depthwise 1-D convolution, 'same' zero padding, a halo of HALO rows
  on each side of a block (its padding past the array masked off)."""
  length, c = x.shape

  def kernel(x_ref, w_ref, o_ref):
    pos = (m.program_id(0) * rows - HALO
           + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0))
    xs = jnp.where((pos >= 0) & (pos < length), x_ref[...], 0.)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for k in range(TAPS):
      acc += xs[k:k + rows] * w_ref[k:k + 1, :]
    o_ref[...] = acc

  return m.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(length, rows), c // 128),
      in_specs=[m.BlockSpec((m.Element(rows + 2 * HALO, (HALO, HALO)), 128),
                            lambda i, j: (i * rows, j)),
                m.BlockSpec((TAPS, 128), lambda i, j: (0, j))],
      out_specs=m.BlockSpec((rows, 128), lambda i, j: (i, j)), **kw)(x, w)


def _conv_ref(x, w):
  xp = jnp.pad(x, ((HALO, HALO), (0, 0)))
  return sum(xp[k:k + x.shape[0]] * w[k] for k in range(TAPS))


def _conv_inputs(length):
  x = jax.random.normal(jax.random.key(0), (length, 256), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (TAPS, 256), jnp.float32)
  return x, w


@pytest.mark.parametrize("length", [256, 300])   # 300: a partial edge block
def test_halo_conv_matches_jnp_and_pallas(length):
  x, w = _conv_inputs(length)
  f = lambda x, w: _conv(pl, x, w, 64, backend="interpret")
  assert _plan(f, x, w).operands[0].windows == ((0, 64), None)
  got = jax.jit(f)(x, w)
  np.testing.assert_allclose(got, _conv_ref(x, w), rtol=1e-5, atol=1e-5)
  theirs = _conv(jpl, x, w, 64, interpret=True)
  np.testing.assert_allclose(got, theirs, rtol=1e-6, atol=1e-6)


def test_halo_conv_lowers_without_a_gather():
  x, w = _conv_inputs(300)
  text = _lowered(lambda x, w: _conv(pl, x, w, 64, backend="interpret"), x, w)
  assert "gather" not in text
  # the same kernel whose windows are not affine in the grid index gathers
  bad = pl.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[0:8]),
      jax.ShapeDtypeStruct((40, 128), jnp.float32), grid=(5,),
      in_specs=[pl.BlockSpec((pl.Element(12, (2, 2)), 128),
                             lambda i: ((i * 3) % 5 * 8, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend="interpret")
  assert "gather" in _lowered(bad, jnp.zeros((40, 128), jnp.float32))


def test_halo_conv_under_vmap_and_grad():
  x, w = _conv_inputs(200)
  xs = jnp.stack([x, 2 * x + 1])
  f = lambda x, w: _conv(pl, x, w, 64, backend="interpret")
  got = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
  want = jax.vmap(_conv_ref, in_axes=(0, None))(xs, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  ct = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  loss = lambda g: lambda x, w: jnp.sum(g(x, w) * ct)
  dx, dw = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
  want_dx, want_dw = jax.grad(loss(_conv_ref), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-3)


def _box(m, x, rows, cols, **kw):
  """3x3 box sum with zero padding: a halo of one row and one column."""
  n0, n1 = x.shape

  def kernel(x_ref, o_ref):
    i, j = m.program_id(0), m.program_id(1)
    r = i * rows - 1 + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
    c = j * cols - 1 + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 1)
    xs = jnp.where((r >= 0) & (r < n0) & (c >= 0) & (c < n1), x_ref[...], 0.)
    o_ref[...] = sum(xs[a:a + rows, b:b + cols]
                     for a in range(3) for b in range(3))

  return m.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(n0, rows), pl.cdiv(n1, cols)),
      in_specs=[m.BlockSpec((m.Element(rows + 2, (1, 1)),
                             m.Element(cols + 2, (1, 1))),
                            lambda i, j: (i * rows, j * cols))],
      out_specs=m.BlockSpec((rows, cols), lambda i, j: (i, j)), **kw)(x)


def test_two_element_dims_with_partial_edge_blocks():
  x = jax.random.normal(jax.random.key(3), (20, 300), jnp.float32)
  f = lambda x: _box(pl, x, 8, 128, backend="interpret")
  assert _plan(f, x).operands[0].windows == ((0, 8), (0, 128))
  got = jax.jit(f)(x)
  xp = jnp.pad(x, 1)
  want = sum(xp[a:a + 20, b:b + 300] for a in range(3) for b in range(3))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, _box(jpl, x, 8, 128, interpret=True),
                             rtol=1e-6, atol=1e-6)


def test_windows_along_a_sequential_grid_dim():
  """The windows step with grid dim 1, which revisits the output block
  (it runs in order): each output block sums its row's windows."""
  def call(m, x, **kw):
    def kernel(x_ref, o_ref):
      @m.when(m.program_id(1) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] += x_ref[...]
    return m.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, 24), jnp.float32), grid=(2, 4),
        in_specs=[m.BlockSpec((8, m.Element(24, (4, 4))),
                              lambda i, j: (i, j * 16))],
        out_specs=m.BlockSpec((8, 24), lambda i, j: (i, 0)), **kw)(x)

  x = jax.random.normal(jax.random.key(4), (16, 64), jnp.float32)
  f = lambda x: call(pl, x, backend="interpret")
  plan = _plan(f, x)
  assert plan.sequential == (1,) and plan.operands[0].windows == (None,
                                                                   (0, 16))
  got = jax.jit(f)(x)
  # the padding reads poison: the sums over its columns are NaN
  xp = np.pad(np.asarray(x), ((0, 0), (4, 4)), constant_values=np.nan)
  want = sum(xp[:, 16 * j:16 * j + 24] for j in range(4))
  assert np.isnan(want[:, :4]).all() and np.isnan(want[:, 20:]).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, call(jpl, x, interpret=True),
                             rtol=1e-6, atol=1e-6)


# --------------------------------------- a scan over a long sequential grid

def _scan(m, x, **kw):
  """h = 0.5 h + x over the rows (a sequential grid), state in scratch,
  reset at the first row."""
  tpu = pltpu if m is pl else jpltpu

  def kernel(x_ref, o_ref, h_ref):
    @m.when(m.program_id(1) == 0)
    def _():
      h_ref[...] = jnp.zeros_like(h_ref)
    h_ref[...] = 0.5 * h_ref[...] + x_ref[...]
    o_ref[...] = h_ref[...]

  spec = m.BlockSpec((1, 128), lambda j, i: (i, j))
  return m.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(x.shape[1] // 128, x.shape[0]), in_specs=[spec], out_specs=spec,
      scratch_shapes=[tpu.VMEM((1, 128), jnp.float32)], **kw)(x)


def _scan_ref(x):
  def body(h, xt):
    h = 0.5 * h + xt
    return h, h
  return jax.lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)[1]


def test_scan_state_is_carried_untransposed_and_matches_jnp_and_pallas():
  """The blocks (1, 128) of the parallel dim 0 and the sequential dim 1
  are slices of the (T, 1, 2, 128) view as it is: nothing is transposed
  in or out of the grid loop, and the step reads the loop counter."""
  x = jax.random.normal(jax.random.key(5), (24, 256), jnp.float32)
  f = lambda x: _scan(pl, x, backend="interpret")
  plan = _plan(f, x)
  assert plan.parallel == (0,) and plan.sequential == (1,)
  text = _lowered(f, x)
  assert "transpose" not in text and "remainder" not in text
  got = jax.jit(f)(x)
  np.testing.assert_allclose(got, _scan_ref(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, _scan(jpl, x, interpret=True),
                             rtol=1e-6, atol=1e-6)
  t = jnp.ones_like(x)
  _, tangent = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
  np.testing.assert_allclose(tangent, _scan_ref(t), rtol=1e-5, atol=1e-5)
