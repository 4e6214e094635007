"""triton_interpret reliability: Triton's own CPU interpreter (loop
indices, constants, comparisons, memory accesses bounded to the run's
buffers). Kernels are compared through
tests.pallas.testing's harness."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from tests.pallas.testing import assert_all_equal, run_backends

BACKEND = "triton_interpret"
COMPARED = (BACKEND, "interpret")
S = jax.ShapeDtypeStruct


# ------------------------------------------------------------------ interpreter

def test_loop_indices_stay_tensors_after_library_calls():
  """Grid dims that revisit an output run as loops in each program; their
  indices are tensors, also in the programs that run after a library
  function (tl.sum) re-patched the language (`.to()` on an int failed)."""
  x = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 24)

  def kernel(x_ref, o_ref):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...]) + j.astype(jnp.float32) * 0.5

  def specs(m):
    return dict(grid=(2, 3), in_specs=[m.BlockSpec((1, 8), lambda i, j: (i, j))],
                out_specs=m.BlockSpec((1, 8), lambda i, j: (i, 0)))
  want = jnp.broadcast_to(x.sum(axis=1, keepdims=True) + 1.5, (2, 8))
  assert_all_equal(run_backends(COMPARED, kernel, S((2, 8), jnp.float32),
                                x, specs=specs, pallas=False), want)


def test_scalar_comparison_broadcast_into_a_store_mask():
  """A comparison of float scalars is int1: broadcast and and-ed with the
  lane mask it made a store mask (it failed: ufunc 'bitwise_and')."""
  def kernel(o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    same = jnp.floor(i.astype(jnp.float32)) == j.astype(jnp.float32)
    mask = jnp.broadcast_to(same, (8,)) & (
        lax.broadcasted_iota(jnp.int32, (8,), 0) < 5)
    o_ref[...] = jnp.zeros((8,), jnp.float32)
    pl.triton.store(o_ref, jnp.full((8,), 1.0), mask=mask)

  def specs(m):
    return dict(grid=(3, 3), out_specs=m.BlockSpec(
        (None, None, 8), lambda i, j: (i, j, 0)))
  want = jnp.zeros((3, 3, 8)).at[jnp.arange(3), jnp.arange(3), :5].set(1.0)
  got = run_backends(COMPARED, kernel, S((3, 3, 8), jnp.float32),
                     specs=specs, pallas=False)
  assert_all_equal(got, want)


def test_bf16_masked_load_past_the_array_with_other():
  """Lanes the mask keeps past the array read poison, the others `other`:
  a Python NaN meeting a bf16 tensor, which the interpreter could not make
  a bf16 constant of (no get_bf16)."""
  x = jnp.array([1.0, -2.0, 0.5, 3.5, 4.0, -1.0], jnp.bfloat16)

  def kernel(x_ref, o_ref):
    keep = lax.broadcasted_iota(jnp.int32, (4,), 0) < 3
    v = pl.triton.load(x_ref, mask=keep, other=jnp.bfloat16(7.0))
    o_ref[...] = jnp.where(jnp.isnan(v), 9.0, v).astype(jnp.bfloat16)

  def specs(m):
    return dict(grid=(2,), in_specs=[m.BlockSpec((4,), lambda i: (i,))],
                out_specs=m.BlockSpec((4,), lambda i: (i,)))
  want = jnp.array([1.0, -2.0, 0.5, 7.0, 4.0, -1.0, 9.0, 7.0], jnp.bfloat16)
  got = run_backends(COMPARED, kernel, S((8,), jnp.bfloat16), x,
                     specs=specs, pallas=False)
  assert_all_equal({BACKEND: got[BACKEND]}, want)


def test_atomic_with_a_broadcast_scalar_value_updates_every_lane():
  """The value of an atomic broadcast from a scalar reached the
  interpreter with zero strides and only lane 0 was right."""
  def kernel(x_ref, acc_ref, o_ref):
    s = jnp.sum(x_ref[...], keepdims=True)          # (1,), then 16 lanes
    pl.triton.atomic_add(o_ref, (pl.ds(0, 16),), jnp.broadcast_to(s, (16,)))

  x = jnp.arange(16, dtype=jnp.float32)
  acc = jnp.full((16,), 2.0, jnp.float32)
  for backend in (BACKEND, "interpret"):
    got = pl.pallas_call(kernel, S((16,), jnp.float32), backend=backend,
                         input_output_aliases={1: 0})(x, acc)
    np.testing.assert_array_equal(got, acc + x.sum(), err_msg=backend)


def _window_from_data_kernel(s_ref, x_ref, o_ref):
  s = s_ref[0]
  o_ref[pl.ds(0, 8)] = x_ref[pl.ds(s, 8)] + 1.0
  o_ref[pl.ds(s, 8)] = x_ref[pl.ds(0, 8)] * 2.0


def _window_from_data(start):
  call = pl.pallas_call(_window_from_data_kernel, S((16,), jnp.float32),
                        backend=BACKEND)
  return np.asarray(call(jnp.array([start], jnp.int32),
                         jnp.arange(16, dtype=jnp.float32)))


@pytest.mark.parametrize("start", [12, 1 << 24, -(1 << 24)])
def test_pl_ds_start_read_from_data_stays_in_the_buffer(start):
  """A window whose start is read from data and runs past the array reads
  poison there and drops those writes (it read and wrote outside the
  buffers); with runtime asserts on it is an out-of-bounds error."""
  got = _window_from_data(start)
  x = np.arange(16, dtype=np.float32)
  want = np.full(16, np.nan, np.float32)    # never written: poison
  if start == 12:
    want[:4], want[12:] = x[12:] + 1.0, x[:4] * 2.0
  np.testing.assert_array_equal(got, want)
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises((jax.errors.JaxRuntimeError, pl.KernelError)) as e:
      _window_from_data(start)
  text = str(e.value)
  assert (f"out-of-bounds load from x_ref[{start}:{start + 8}] (a window "
          "placed at run time)") in text
  assert "test_reliability_triton_interpreter.py" in text


def test_pointers_outside_every_buffer_are_dropped_or_reported():
  """The interpreter's loads, stores and atomics check their addresses
  against the run's buffers (whatever the generated code computed)."""
  from lowering_triton import interpret_memory as im
  buf = np.arange(8, dtype=np.float32)
  base = buf.ctypes.data
  ptrs = np.array([base, base + 28, base + 32, base - 4], np.uint64)
  with im.guard({"x": buf}, report=False):
    p, m = im._checked_mask(ptrs, None, 4, "load")
  np.testing.assert_array_equal(m, [True, True, False, False])
  assert (p[~m] == base).all()
  with im.guard({"x": buf}, report=True):
    with pytest.raises(im.OutOfBounds, match="x \\+ 32 bytes"):
      im._checked_mask(ptrs, None, 4, "store")
    im._checked_mask(ptrs, np.array([1, 1, 0, 0], bool), 4, "store")
