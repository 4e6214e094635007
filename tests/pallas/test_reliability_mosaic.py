"""`mosaic_interpret` gives jax.numpy's answer where hardware could differ:
NaN in reductions, rolls by any amount, jnp's choices for operations MLIR
leaves undefined, poison in block padding and fresh buffers, and block
indices read from data that leave the array. Shapes are TPU-legal; where
Pallas's interpret mode runs the same kernel it is compared too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from dsl.core.jax_internals import config as jax_config
from jax.experimental import pallas as jpl

import dsl as pl
import lowering_mosaic
from dsl import tpu as pltpu
from dsl.core.errors import BackendError, KernelError
from dsl.core.poison import poison_value
from tests.pallas.testing import PALLAS, assert_same, run_on

MI = "mosaic_interpret"


def _rows(dtype):
  """A TPU tile's rows for `dtype` (8 for 32-bit, 16 for 16-bit, 32 for 8-bit)."""
  return 32 // jnp.dtype(dtype).itemsize


def _same(got, want):
  """Equal, NaN where NaN, and the same sign of zero."""
  assert_same(got, want, signed_zeros=True)


def _elementwise(fn, *xs, backend=MI):
  """fn(*blocks) over whole-array blocks: (got, want)."""
  (got,), (want,) = _elementwise_all([fn], *xs, backend=backend)
  return got, want


def _elementwise_all(fns, *xs, backend=MI):
  """Every fn(*blocks) in one kernel (one output each): (gots, wants)."""
  wants = [fn(*xs) for fn in fns]

  def kernel(*refs):
    vals = [r[...] for r in refs[:len(xs)]]
    for fn, o_ref in zip(fns, refs[len(xs):]):
      o_ref[...] = fn(*vals)
  gots = run_on(backend, kernel, [jax.ShapeDtypeStruct(w.shape, w.dtype)
                                  for w in wants], *xs)
  return gots, wants


def _all_same(fns, *xs, backend=MI):
  for got, want in zip(*_elementwise_all(fns, *xs, backend=backend)):
    _same(got, want)


# ------------------------------------------------------------ NaN

def _with_nans(dtype):
  x = (jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128) % 37)
  x = x.at[1, 5].set(jnp.nan).at[2, 0].set(jnp.nan).at[2, 100].set(jnp.nan)
  return x.at[3, 127].set(jnp.nan).at[9, 64].set(jnp.nan).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_arg_reductions_return_the_first_nan(dtype):
  x = _with_nans(dtype)
  fns = [lambda v, op=op, axis=axis: jnp.broadcast_to(
      jnp.expand_dims(op(v, axis=axis), axis).astype(jnp.int32), v.shape)
      for op in (jnp.argmax, jnp.argmin) for axis in (0, 1)]
  for backend in (MI, PALLAS):
    _all_same(fns, x, backend=backend)


def test_max_min_propagate_nan():
  x = _with_nans(jnp.float32)
  reductions = [lambda u, v, op=op: jnp.broadcast_to(
      op(u, axis=1, keepdims=True), u.shape) for op in (jnp.max, jnp.min)]
  (mx, mn), _ = _elementwise_all(reductions, x, x[::-1])
  assert np.isnan(mx[[1, 2, 3, 9], 0]).all()
  assert np.isnan(mn[[1, 2, 3, 9], 0]).all()
  fns = reductions + [jnp.maximum, jnp.minimum, lax.max, lax.min]
  for backend in (MI, PALLAS):
    _all_same(fns, x, x[::-1], backend=backend)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint32])
def test_unsigned_reductions_compare_unsigned(dtype):
  x = jnp.asarray(np.random.RandomState(0).randint(
      0, 255, (_rows(dtype), 128)).astype(dtype))
  _all_same([lambda v, op=op: jnp.broadcast_to(
      op(v, axis=1, keepdims=True).astype(dtype), v.shape)
      for op in (jnp.max, jnp.min, jnp.argmax)], x)


# ------------------------------------------------------------ roll

@pytest.mark.parametrize("axis", [0, 1])
def test_jnp_roll_by_any_static_amount(axis):
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  n = x.shape[axis]
  _all_same([lambda v, s=shift: jnp.roll(v, s, axis)
             for shift in (0, n, -n, 2 * n, 3, -3, n + 3, -(n + 3))], x)


def test_pltpu_roll_normalizes_static_and_dynamic_shifts():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

  def static(x_ref, o_ref):
    o_ref[...] = pltpu.roll(x_ref[...], 128, 1)
  f = lambda x: pl.pallas_call(static, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               backend=MI)(x)
  assert "dynamic_rotate" not in lowering_mosaic.to_mlir(f, x)  # identity
  _same(f(x), x)

  def dynamic(s_ref, x_ref, o_ref):
    s = s_ref[0]
    o_ref[...] = pltpu.roll(x_ref[...], s, 1) + pltpu.roll(x_ref[...], s, 0)
  g = pl.pallas_call(
      dynamic, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, s: (0, 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, s: (0, 0))), backend=MI)
  for shift in (0, 1, 128, 131, -1, -128, -131):
    got = g(jnp.array([shift], jnp.int32), x)
    _same(got, jnp.roll(x, shift, 1) + jnp.roll(x, shift, 0))


def test_other_zero_size_values_are_a_clear_error():
  def kernel(x_ref, o_ref):
    empty = x_ref[...][:, :0]
    o_ref[...] = x_ref[...] + jnp.sum(empty + 1.0)
  x = jnp.ones((8, 128), jnp.float32)
  with pytest.raises(BackendError, match="zero-size arrays are not supported"):
    pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                   backend=MI)(x)


# ------------------------------------------------------------ undefined arithmetic

def _int_operands(dtype):
  info = jnp.iinfo(dtype)
  vals = [7, 0, int(info.max), int(info.min), 5, 1, 2, 3]
  if info.min < 0:
    vals[4], vals[7] = -7, -1
  shape = (_rows(dtype), 128)
  x = np.resize(np.array(vals, np.int64), shape)
  y = np.resize(np.repeat(vals, 8)[::-1], shape)   # every pair, 0 and -1
  return jnp.asarray(x.astype(dtype)), jnp.asarray(y.astype(dtype))


INT_TYPES = [jnp.int32, jnp.int8, jnp.uint8, jnp.uint32]


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_integer_division_and_remainder_as_jnp(dtype):
  x, y = _int_operands(dtype)
  assert (np.asarray(y) == 0).any()
  fns = [lax.div, lax.rem, jnp.floor_divide, jnp.remainder,
         lambda a, b: a // 0, lambda a, b: a % 0, lambda a, b: a // 3]
  if jnp.iinfo(dtype).min < 0:     # INT_MIN // -1 wraps to INT_MIN
    fns += [lambda a, b: a // -1, lambda a, b: a % -1]
  _all_same(fns, x, y)


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_shifts_by_the_width_or_more_and_not_as_jnp(dtype):
  x, _ = _int_operands(dtype)
  width = jnp.iinfo(dtype).bits
  amounts = np.resize(np.array([0, 1, width - 1, width, width + 1, 2 * width,
                                3, 255]), x.shape).astype(np.int64)
  if jnp.iinfo(dtype).min < 0:
    amounts[0] = -1
  s = jnp.asarray(amounts.astype(dtype))
  _all_same([lax.shift_left, lax.shift_right_logical,
             lax.shift_right_arithmetic,
             lambda a, b: lax.shift_left(a, jnp.asarray(width, dtype)),
             lambda a, b: lax.shift_right_arithmetic(a, jnp.asarray(width,
                                                                    dtype)),
             lambda a, b: ~a], x, s)


def test_not_on_bool():
  b = jnp.asarray(np.resize(np.array([True, False]), (32, 128)))
  _all_same([jnp.invert, jnp.logical_not], b)


SPECIAL = [np.nan, np.inf, -np.inf, 1e10, -1e10, 3.7, -3.7, 300, -300, 127.5,
           -128.5, -0.5, 2.0 ** 31, -2.0 ** 31, 255.9, 256]


@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16])
def test_float_to_int_casts_saturate_and_send_nan_to_zero(src):
  f = jnp.asarray(np.resize(np.array(SPECIAL, np.float32),
                            (32, 128))).astype(src)
  _all_same([lambda v, d=d: v.astype(d) for d in
             (jnp.int32, jnp.int8, jnp.uint8, jnp.uint32, jnp.int16,
              jnp.bool_)], f)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_signed_zeros_in_maximum_minimum_and_reductions(dtype):
  shape = (_rows(dtype), 128)
  a = jnp.asarray(np.resize(np.array([0., -0.], np.float32), shape)).astype(
      dtype)
  b = jnp.asarray(np.resize(np.array([-0., 0.], np.float32), shape)).astype(
      dtype)
  fns = [jnp.maximum, jnp.minimum,
         lambda u, v: jnp.broadcast_to(jnp.max(u, 1, keepdims=True), shape),
         lambda u, v: jnp.broadcast_to(jnp.min(v, 1, keepdims=True), shape)]
  _all_same(fns, a, b)
  _all_same(fns[:2], a, b, backend=PALLAS)


# ------------------------------------------------------------ poison

def _row_sums(backend, x):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...], axis=1, keepdims=True),
                                  o_ref.shape)
  def specs(api):
    return dict(in_specs=[api.BlockSpec((8, 256), lambda i: (0, i))],
                out_specs=api.BlockSpec((8, 128), lambda i: (0, i)))
  return run_on(backend, kernel, jax.ShapeDtypeStruct((8, 256), x.dtype), x,
                grid=(2,), specs=specs)


def test_edge_block_padding_reads_poison():
  """A kernel that wrongly reduces over the padding of the edge block gets
  NaN, as in Pallas's interpret mode (hardware reads garbage there)."""
  x = jnp.ones((8, 300), jnp.float32)
  for backend in (MI, PALLAS):
    got = _row_sums(backend, x)
    np.testing.assert_array_equal(got[:, 0], 256.0)
    assert np.isnan(got[:, 128]).all()

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.min(x_ref[...], axis=1, keepdims=True),
                                  o_ref.shape)
  xi = jnp.ones((8, 300), jnp.int32)
  got = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 256), jnp.int32), grid=(2,),
      in_specs=[pl.BlockSpec((8, 256), lambda i: (0, i))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)), backend=MI)(xi)
  np.testing.assert_array_equal(got[:, 0], 1)
  np.testing.assert_array_equal(got[:, 128], poison_value(np.int32))


@pytest.mark.parametrize("poison", [False, True])
def test_scratch_and_run_scoped_start_as_poison_when_asked(poison):
  def kernel(o_ref, f_ref, i_ref):       # a fresh kernel: lowered anew
    def scoped(r):
      o_ref[:, 256:] = r[...]
    o_ref[:, :128] = f_ref[...]
    o_ref[:, 128:256] = i_ref[...].astype(jnp.float32)
    pl.run_scoped(scoped, pltpu.VMEM((8, 128), jnp.float32))
  with jax_config.jax_pallas_poison_buffers(poison):
    got = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, 384), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                        pltpu.VMEM((8, 128), jnp.int32)], backend=MI)()
  want = ([np.nan, np.float32(poison_value(np.int32)), np.nan] if poison
          else [0.0, 0.0, 0.0])
  np.testing.assert_array_equal(got[0, ::128], want)


# ------------------------------------------------------------ block indices from data

def _gather_blocks(idx, x):
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (3 - idx[i], 0))),
      backend=MI)(idx, x)


def test_block_indices_from_data_outside_the_array():
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  got = _gather_blocks(jnp.array([0, 8, 2, -3], jnp.int32), x)
  # in range: block 0 -> block 3, block 2 -> block 1; outside: nothing is
  # read or written past the array (reads see poison, writes are dropped);
  # blocks no step writes keep the output's uninitialized memory (poison)
  np.testing.assert_array_equal(got[24:], x[:8] + 1)
  np.testing.assert_array_equal(got[8:16], x[16:24] + 1)
  assert np.isnan(got[:8]).all() and np.isnan(got[16:24]).all()
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises((jax.errors.JaxRuntimeError, KernelError)) as e:
      jax.block_until_ready(_gather_blocks(jnp.array([0, 8, 2, 1], jnp.int32),
                                           x))
  text = str(e.value)
  assert "kernel 'kernel'" in text and "in_specs[0]" in text
  assert "block index (8, 0) at grid point (1,)" in text
  assert "dim 0: block indices below 4" in text
  assert "not element offsets" in text
  assert "test_reliability_mosaic.py" in text      # the index map's line


# ------------------------------------------------------------ indexing

def test_negative_static_row_index_counts_from_the_end():
  """x_ref[-k] is row n - k, as in numpy (it was an out-of-bounds [-1:0])."""
  x = jnp.arange(3 * 16 * 128, dtype=jnp.float32).reshape(3, 16, 128)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[-1] + x_ref[-3] * 2 + x_ref[1, -2:][None].sum(1)
  want = x[2] + x[0] * 2 + x[1, -2:].sum(0)
  for backend in (MI, "interpret", PALLAS):
    got = run_on(backend, kernel,
                 jax.ShapeDtypeStruct((16, 128), jnp.float32), x)
    np.testing.assert_array_equal(got, want, err_msg=backend)


def _tail_kernel(api, masked, n, block):
  """The Triton idiom on whole-array refs: program i loads and stores the
  window pl.ds(i * block, block) under the mask of the lanes in the array
  (`api`: dsl or jax.experimental.pallas; `masked`: its masked load/store)."""
  def kernel(x_ref, o_ref):
    i = api.program_id(0)
    lanes = i * block + lax.broadcasted_iota(jnp.int32, (8, block), 1)
    mask = lanes < n
    window = (slice(None), api.ds(i * block, block))
    x = masked.load(x_ref.at[window], mask=mask, other=-1)
    masked.store(o_ref.at[window], x * 2 + 1, mask=mask)
  return kernel


def test_masked_window_past_the_end_of_a_whole_array_ref():
  """The window of the last program runs past the end of the array into
  the padding of its VMEM tile: masked-off lanes read poison, which the
  mask replaces, and are not written (it failed with out-of-bounds)."""
  from jax.experimental.pallas import triton as jpl_triton
  n, block = 200, 128
  x = jnp.arange(8 * n, dtype=jnp.float32).reshape(8, n)
  for backend in (MI, "interpret", PALLAS):
    api, masked = (jpl, jpl_triton) if backend == PALLAS else (pl, pl.triton)
    got = run_on(backend, _tail_kernel(api, masked, n, block),
                 jax.ShapeDtypeStruct((8, n), jnp.float32), x, grid=(2,))
    np.testing.assert_array_equal(got, x * 2 + 1, err_msg=backend)


def test_masked_store_keeping_a_lane_past_the_end_is_out_of_bounds():
  n, block = 200, 128

  def kernel(o_ref):
    i = pl.program_id(0)
    window = (slice(None), pl.ds(i * block, block))
    pl.triton.store(o_ref.at[window], jnp.ones((8, block), jnp.float32),
                    mask=jnp.ones((8, block), bool))
  with pytest.raises((jax.errors.JaxRuntimeError, KernelError)) as e:
    jax.block_until_ready(pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, n), jnp.float32), grid=(2,),
        backend=MI)())
  assert "out-of-bounds store" in str(e.value)
  assert "test_reliability_mosaic.py" in str(e.value)


def test_masked_store_of_narrow_elements_is_a_clear_error():
  """TPUs store under a mask only 32-bit elements: the lowering says so
  (it was a Mosaic module that did not verify, with no reason given)."""
  def kernel(x_ref, o_ref):
    pl.triton.store(o_ref.at[:, pl.ds(0, 128)], x_ref[:, pl.ds(0, 128)],
                    mask=lax.broadcasted_iota(jnp.int32, (32, 128), 1) < 5)
  with pytest.raises(BackendError) as e:
    pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.int8),
                   backend=MI)(jnp.ones((32, 128), jnp.int8))
  text = str(e.value)
  assert "masked store" in text and "int8" in text and "32-bit" in text
  assert "test_reliability_mosaic.py" in text


def test_a_module_that_does_not_verify_names_the_reason(monkeypatch):
  """The one-line message carries MLIR's first error, not only its
  "Verification failed:" header."""
  from lowering_mosaic.tpu.rules import memory
  monkeypatch.setattr(memory, "_element_bits", lambda ref: 32)

  def kernel(x_ref, o_ref):
    pl.triton.store(o_ref.at[:, pl.ds(0, 128)], x_ref[:, pl.ds(0, 128)],
                    mask=lax.broadcasted_iota(jnp.int32, (32, 128), 1) < 5)
  with pytest.raises(BackendError) as e:
    pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.int8),
                   backend=MI)(jnp.ones((32, 128), jnp.int8))
  first = str(e.value).splitlines()[0]
  assert "does not verify: error:" in first
  assert "non-32-bit element type" in first


def test_grid_free_kernel_with_a_window_is_refused_as_on_a_tpu():
  """A grid-free Mosaic kernel has no windows (as Pallas emits it): a block
  that is not the whole array would be silently read whole, so it is refused
  at trace time with the fix."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  x = jnp.ones((2, 40, 128), jnp.float32)
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((1, 32, 128), jnp.float32),
      in_specs=[pl.BlockSpec((None, 32, 128), lambda: (1, 0, 0))],
      out_specs=pl.BlockSpec((None, 32, 128), lambda: (0, 0, 0)),
      backend="mosaic_interpret")
  with pytest.raises(pl.KernelError, match=r"in_specs\[0\]: a kernel without "
                     r"a grid sees whole operands.*grid=\(1,\)"):
    call(x)
  # the same kernel with a one-point grid runs and matches
  got = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((1, 32, 128), jnp.float32), grid=(1,),
      in_specs=[pl.BlockSpec((None, 32, 128), lambda i: (1, 0, 0))],
      out_specs=pl.BlockSpec((None, 32, 128), lambda i: (0, 0, 0)),
      backend="mosaic_interpret")(x)
  np.testing.assert_array_equal(got, x[1:2, :32] * 2.0)
