"""Masks in the generated Triton source: none where the range analysis
proves a run-time coordinate inside its array, the masks (and, with runtime
asserts, the checks) of before where it does not; the kernels give the same
numbers as jnp and as Pallas either way."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
import lowering_triton
from benchmarks.gpu_triton import make_matmul
from benchmarks.suite.matmul_bench import Matmul
from dsl.core import config as dsl_config
from dsl import triton as plt
from tests.pallas.testing import array, assert_close

S = jax.ShapeDtypeStruct


def _kernel_source(src: str) -> str:
  return src[src.index("@triton.jit"):src.index("\nGRID")]


def test_benchmark_matmul_k_loop_loads_without_masks():
  """The K loop of the bf16 4096^3 benchmark matmul (a fori_loop with a
  static trip count over pl.ds(k * bk, bk), K % bk == 0) reads as before
  masks were added for coordinates computed at run time (through pointers,
  and, the default, through tensor descriptors: windows that need no mask)."""
  x = S((4096, 4096), jnp.bfloat16)
  with dsl_config.triton_tensor_descriptors_option(False):
    (src,) = lowering_triton.to_source(make_matmul(pl), x, x)
  body = _kernel_source(src)
  assert "mask=" not in body and "other=" not in body
  assert ("x = tl.load(x_ptr + x_start0 * 4096 + mul + tl.arange(0, 128)"
          "[:, None] * 4096 + tl.arange(0, 64)[None, :])" in body)
  assert ("y = tl.load(y_ptr + mul_1 * 4096 + y_start1 + tl.arange(0, 64)"
          "[:, None] * 4096 + tl.arange(0, 128)[None, :])" in body)
  (src,) = lowering_triton.to_source(make_matmul(pl), x, x)
  body = _kernel_source(src)
  assert "mask=" not in body and "tl.load(" not in body
  assert "x = x_desc.load([x_start0, mul])" in body


def _loop_kernel(trips, shift=0):
  def kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[:, pl.ds(i * 32 + shift, 32)]
    o_ref[...] = lax.fori_loop(0, trips, body,
                               jnp.zeros((8, 32), jnp.float32))

  def f(x, backend="triton"):
    return pl.pallas_call(
        kernel, S((16, 32), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 32), lambda i: (i, 0)),
        backend=backend)(x)
  return f


@pytest.mark.parametrize("trips,shift,masks", [
    (4, 0, []),
    (5, 0, ["x_cols[None, :] < 128"]),
    (4, 3, ["x_cols[None, :] < 128"]),
    (4, -2, ["x_cols[None, :] >= 0"]),
])
def test_only_unproven_bounds_are_masked(trips, shift, masks):
  x = S((16, 128), jnp.float32)
  (src,) = lowering_triton.to_source(_loop_kernel(trips, shift), x)
  body = _kernel_source(src)
  for m in masks:
    assert m in body
  assert ("mask=" in body) == bool(masks)
  assert ("x_cols[None, :] >= 0" in body) == ("x_cols[None, :] >= 0" in masks)
  with pl.config.enable_runtime_assert_option(True):
    (checked,) = lowering_triton.to_source(_loop_kernel(trips, shift), x)
  assert ("tl.device_assert" in checked) == bool(masks)


@pytest.mark.parametrize("backend", ["triton_interpret", "interpret"])
def test_proven_windows_give_the_numbers_of_jnp(backend):
  x = array(0, (16, 128), jnp.float32)
  got = jax.jit(lambda x: _loop_kernel(4)(x, backend))(x)
  want = x.reshape(16, 4, 32).sum(1)
  assert_close(got, want)


def test_an_unproven_window_past_the_end_still_reads_poison():
  """Memory safety stays the rule where nothing is proven: the fifth
  window lies past the array and reads poison (NaN), never another row."""
  x = array(0, (16, 128), jnp.float32)
  got = jax.jit(lambda x: _loop_kernel(5)(x, "triton_interpret"))(x)
  assert np.isnan(np.asarray(got)).all()
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises((jax.errors.JaxRuntimeError, pl.KernelError),
                       match="a window placed at run time"):
      jax.block_until_ready(
          jax.jit(lambda x: _loop_kernel(5)(x, "triton_interpret"))(x))


@pytest.mark.parametrize("size,dtype", [((32, 64, 32), jnp.float32),
                                        ((16, 32, 64), jnp.bfloat16)])
def test_loop_k_matmul_matches_jnp_and_pallas(size, dtype):
  """The benchmark suite's loop_k matmul (the same source under dsl on
  triton_interpret, and under Pallas's interpret mode) with its K loop
  unmasked."""
  bench = Matmul()
  config = {"variant": "loop_k", "bm": 16, "bn": 32, "bk": 16}
  x, y = bench.inputs(size, dtype)
  (src,) = lowering_triton.to_source(
      bench.build(pl, size, dtype, config, backend="triton"), x, y)
  assert "mask=" not in _kernel_source(src)
  got = jax.jit(bench.build(pl, size, dtype, config,
                            backend="triton_interpret"))(x, y)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental import pallas as jpl
    peer = jax.jit(bench.build(jpl, size, dtype, config, interpret=True))(x, y)
  assert_close(got, bench.reference(x, y), dtype)
  assert_close(got, peer, dtype)


def _cas_kernel(start_of):
  def kernel(s_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    def body(i, c):
      plt.atomic_cas(o_ref.at[pl.ds(start_of(s_ref, i), 4)],
                     jnp.zeros((4,), jnp.int32), jnp.full((4,), 1, jnp.int32))
      return c
    lax.fori_loop(0, 4, body, 0)
  return lambda s, backend="triton": pl.pallas_call(
      kernel, S((16,), jnp.int32), backend=backend)(s)


def test_atomic_cas_takes_proven_run_time_windows_and_refuses_others():
  """Triton's atomic_cas has no mask: a window whose start is computed at
  run time goes through only where the analysis proves it inside."""
  s = jnp.array([3], jnp.int32)
  proven = _cas_kernel(lambda s_ref, i: i * 4)
  got = jax.jit(lambda s: proven(s, "triton_interpret"))(s)
  np.testing.assert_array_equal(got, np.ones(16, np.int32))
  unproven = _cas_kernel(lambda s_ref, i: s_ref[0] + i)
  with pytest.raises(pl.BackendError, match="not proven inside the array"):
    lowering_triton.to_source(unproven, s)


def _causal_kernel(x_ref, o_ref):
  """Row block i sums the column windows 0..i: a loop whose trip count
  depends on the program id (a while loop in the jaxpr, a for loop in the
  source)."""
  i = pl.program_id(0)
  def body(k, acc):
    return acc + x_ref[:, pl.ds(k * 32, 32)]
  o_ref[...] = lax.fori_loop(0, i + 1, body, jnp.zeros((8, 32), jnp.float32))


def _causal(x, backend="triton"):
  return pl.pallas_call(
      _causal_kernel, S((32, 32), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 32), lambda i: (i, 0)), backend=backend)(x)


@pytest.mark.parametrize("vmapped", [False, True])
def test_loops_bounded_by_program_ids_and_vmapped_kernels_are_unmasked(
    vmapped):
  x = array(1, (32, 128), jnp.float32)
  fn = jax.vmap(_causal) if vmapped else _causal
  xs = jnp.stack([x, 2 * x]) if vmapped else x
  (src,) = lowering_triton.to_source(fn, xs)
  body = _kernel_source(src)
  assert "for k in tl.range(" in body and "while" not in body
  assert "mask=" not in body
  got = jax.jit(lambda a: (jax.vmap(_causal, in_axes=(0, None)) if vmapped
                           else _causal)(a, "triton_interpret"))(xs)
  blocks = x.reshape(4, 8, 4, 32)
  want = jnp.stack([blocks[i, :, :i + 1].sum(1) for i in range(4)]
                   ).reshape(32, 32)
  assert_close(got, jnp.stack([want, 2 * want]) if vmapped else want)


def test_windows_inside_a_partial_edge_block_keep_the_blocks_mask():
  """A window proven inside its block needs no mask of its own; the
  block's mask at the array's end stays (the last block is partial)."""
  def kernel(x_ref, o_ref):
    def body(k, c):
      o_ref[pl.ds(k * 8, 8)] = x_ref[pl.ds(k * 8, 8)] * 2.0
      return c
    lax.fori_loop(0, 4, body, 0)

  def f(x, backend="triton"):
    spec = pl.BlockSpec((32,), lambda i: (i,))
    return pl.pallas_call(kernel, S((100,), jnp.float32), grid=(4,),
                          in_specs=[spec], out_specs=spec, backend=backend)(x)
  x = array(2, (100,), jnp.float32)
  (src,) = lowering_triton.to_source(f, x)
  body = _kernel_source(src)
  assert "x_offs < 100" in body and "x_offs >= 0" not in body
  got = jax.jit(lambda x: f(x, "triton_interpret"))(x)
  assert_close(got, x * 2.0)


def _row_window_kernel(trips):
  """Row windows placed at run time inside an (8, 128) block of a (16, 128)
  array: the block, not the array, is the ref they must stay in."""
  def kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[pl.ds(i * 4, 4), :]
    o_ref[...] = lax.fori_loop(0, trips, body,
                               jnp.zeros((4, 128), jnp.float32))

  def f(x, backend="triton"):
    return pl.pallas_call(
        kernel, S((8, 128), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((4, 128), lambda i: (i, 0)),
        backend=backend)(x)
  return f


@pytest.mark.parametrize("trips", [2, 3])
def test_windows_proven_inside_the_block_drop_its_limits(trips):
  """A window proven inside its block needs no mask at the block's end;
  one that may run past it keeps the mask, and reads poison there, never
  the next block's rows."""
  x = S((16, 128), jnp.float32)
  (src,) = lowering_triton.to_source(_row_window_kernel(trips), x)
  assert ("mask=" in _kernel_source(src)) == (trips == 3)
  xv = array(0, (16, 128), jnp.float32)
  got = np.asarray(jax.jit(
      lambda x: _row_window_kernel(trips)(x, "triton_interpret"))(xv))
  if trips == 2:
    want = xv.reshape(2, 2, 4, 128).sum(1).reshape(8, 128)
    assert_close(got, want)
  else:
    assert np.isnan(got).all()


def _column_loop(trips, shift=0, masked=True):
  """The loop of Pallas's GPU layer norm: columns `i * 128 + arange(128)`
  read through an array of indices, masked at the row's end."""
  def kernel(x_ref, o_ref):
    def body(i, acc):
      cols = i * 128 + shift + jnp.arange(128)
      if not masked:
        return acc + plt.load(x_ref.at[cols])
      return acc + plt.load(x_ref.at[cols], mask=cols < 512, other=0.0)
    o_ref[...] = lax.fori_loop(0, trips, body, jnp.zeros(128, jnp.float32))

  def f(x, backend="triton"):
    return pl.pallas_call(kernel, S((128,), jnp.float32),
                          backend=backend)(x)
  return f


@pytest.mark.parametrize("trips,shift,masked,wrap,clamp", [
    (4, 0, True, False, False),   # every index inside: plain pointers
    (5, 0, True, False, False),   # past the end, but only where masked off
    (5, 0, False, False, True),   # past the end: clamped as a gather clamps
    (4, -1, True, True, True),    # maybe negative: counted from the end too
])
def test_arrays_of_indices_proven_inside_are_neither_wrapped_nor_clamped(
    trips, shift, masked, wrap, clamp):
  f = _column_loop(trips, shift, masked)
  (src,) = lowering_triton.to_source(f, S((512,), jnp.float32))
  body = _kernel_source(src)
  assert ("< 0, " in body) == wrap
  assert ("tl.minimum(tl.maximum(" in body) == clamp
  x = array(3, (512,), jnp.float32)
  got = jax.jit(lambda x: f(x, "triton_interpret"))(x)
  assert_close(got, jax.jit(lambda x: f(x, "interpret"))(x))
  if shift == 0 and masked:
    assert_close(got, x.reshape(4, 128).sum(0))
