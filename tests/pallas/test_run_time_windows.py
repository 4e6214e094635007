"""Windows placed at run time (`pl.ds` starts and indices read from data)
that leave their ref: on every CPU backend the lanes outside read poison
and write nothing (never another row), and with runtime asserts the access
is a KernelCheckError worded the same on every backend (the access with its
values, the ref, the block index, the grid point, the user's line)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt
from tests.pallas import testing
from tests.pallas.testing import CPU_BACKENDS

SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
X = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)


def load_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]   # LOAD-LINE


def store_kernel(i_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[pl.ds(i_ref[0], 4), :] = jnp.ones((4, 128), jnp.float32)


def _load(backend, start):
  return pl.pallas_call(load_kernel, jax.ShapeDtypeStruct((8, 128),
                                                          jnp.float32),
                        in_specs=[SMEM, None], backend=backend)(
                            jnp.array([start], jnp.int32), X)


def _store(backend, start):
  return pl.pallas_call(store_kernel, jax.ShapeDtypeStruct((16, 128),
                                                           jnp.float32),
                        in_specs=[SMEM], backend=backend)(
                            jnp.array([start], jnp.int32))


def _rows_read(start, n=8, rows=16):
  """Column 0 of the rows a window of n rows at `start` reads: NaN outside."""
  return np.array([128.0 * r if 0 <= r < rows else np.nan
                   for r in range(start, start + n)], np.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("start", [100, 12, -3, -100, 4])
def test_load_past_the_end_reads_poison(backend, start):
  got = np.asarray(jax.jit(lambda: _load(backend, start))())
  np.testing.assert_array_equal(got[:, 0], _rows_read(start))
  np.testing.assert_array_equal(got[:, 1] - got[:, 0], np.where(
      np.isnan(_rows_read(start)), np.nan, 1.0))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("start", [14, 100, -2, 3])
def test_store_past_the_end_writes_nothing_outside(backend, start):
  got = np.asarray(_store(backend, start))[:, 0]
  want = np.zeros(16, np.float32)
  for r in range(start, start + 4):
    if 0 <= r < 16:
      want[r] = 1.0
  np.testing.assert_array_equal(got, want)


def _message(fn):
  with pytest.raises(pl.KernelCheckError) as e:
    jax.block_until_ready(fn())
  return str(e.value)


def test_runtime_asserts_give_one_message_on_every_backend(runtime_asserts):
  loads = {b: _message(lambda: _load(b, 100)) for b in CPU_BACKENDS}
  stores = {b: _message(lambda: _store(b, 14)) for b in CPU_BACKENDS}
  assert len(set(loads.values())) == 1, loads
  assert len(set(stores.values())) == 1, stores
  load = loads["interpret"]
  assert "out-of-bounds load from x_ref[100:108, :]" in load
  assert "outside its ref of shape (16, 128) at grid point ()" in load
  line = testing.line_of(__file__, "# LOAD-LINE")
  assert f"test_run_time_windows.py:{line}" in load     # the user's line
  assert "store to o_ref[14:18, :]" in stores["interpret"]
  # in range: no error
  for b in CPU_BACKENDS:
    np.testing.assert_array_equal(np.asarray(_load(b, 8))[:, 0],
                                  _rows_read(8))


def blocked_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]


def _blocked(backend):
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  return pl.pallas_call(
      blocked_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
      grid=(2,), in_specs=[SMEM, pl.BlockSpec((16, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      backend=backend)(jnp.array([12], jnp.int32), x)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_window_leaving_its_block_never_reads_the_next_block(backend):
  # rows 12..19 of a 16-row block: 16..19 belong to the next block.
  got = np.asarray(_blocked(backend))[:, 0]
  want = np.concatenate([_rows_read(12), _rows_read(28, rows=32)])
  np.testing.assert_array_equal(got, want)


def test_blocked_message_names_block_index_and_grid_point(runtime_asserts):
  msgs = {b: _message(lambda: _blocked(b)) for b in CPU_BACKENDS}
  assert len(set(msgs.values())) == 1, msgs
  assert ("x_ref[12:20, :] (a window placed at run time) outside its ref of "
          "shape (16, 128) at block index (0, 0) and grid point (0,)"
          in msgs["interpret"])


def scratch_kernel(i_ref, x_ref, o_ref, acc_ref):
  acc_ref[...] = x_ref[...]
  acc_ref[pl.ds(i_ref[1], 8), :] = jnp.full((8, 128), 7.0, jnp.float32)
  o_ref[...] = acc_ref[pl.ds(i_ref[0], 8), :]


def _scratch(backend, starts):
  return pl.pallas_call(
      scratch_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[SMEM, None], scratch_shapes=[pltpu.VMEM((16, 128),
                                                        jnp.float32)],
      backend=backend)(jnp.array(starts, jnp.int32), X)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scratch_windows(backend):
  got = np.asarray(_scratch(backend, [12, 12]))[:, 0]
  np.testing.assert_array_equal(got, [7, 7, 7, 7] + [np.nan] * 4)
  got = np.asarray(_scratch(backend, [-3, 20]))[:, 0]
  np.testing.assert_array_equal(got, _rows_read(-3))


def test_scratch_message(runtime_asserts):
  msgs = {b: _message(lambda: _scratch(b, [0, 12])) for b in CPU_BACKENDS}
  assert len(set(msgs.values())) == 1, msgs
  assert "store to acc_ref[12:20, :]" in msgs["interpret"]


def masked_kernel(i_ref, x_ref, o_ref):
  rows = i_ref[0] + jnp.arange(8)
  mask = (rows < i_ref[1])[:, None]
  o_ref[...] = plt.load(x_ref.at[pl.ds(i_ref[0], 8), :], mask=mask,
                        other=-1.0)


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_masked_load_keeps_only_the_lanes_it_masks(backend, runtime_asserts):
  f = pl.pallas_call(masked_kernel, jax.ShapeDtypeStruct((8, 128),
                                                         jnp.float32),
                     in_specs=[SMEM, None], backend=backend)
  got = np.asarray(f(jnp.array([12, 16], jnp.int32), X))[:, 0]
  np.testing.assert_array_equal(got, [1536, 1664, 1792, 1920, -1, -1, -1,
                                      -1])
  with pytest.raises(pl.KernelCheckError, match=r"x_ref\[12:20, :\]"):
    jax.block_until_ready(f(jnp.array([12, 18], jnp.int32), X))


def row_loop_kernel(x_ref, o_ref):
  def body(r, carry):
    o_ref[pl.ds(r, 1), :] = x_ref[pl.ds(r, 1), :] * 2
    return carry
  jax.lax.fori_loop(0, x_ref.shape[0], body, 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_windows_inside_the_ref_are_unchanged(backend, runtime_asserts):
  got = pl.pallas_call(row_loop_kernel, jax.ShapeDtypeStruct(X.shape,
                                                             X.dtype),
                       backend=backend)(X)
  np.testing.assert_array_equal(got, X * 2)


def prefetch_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...]


def test_block_index_from_data_same_message_everywhere(runtime_asserts):
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(2, 3),
      in_specs=[pl.BlockSpec((8, 128), lambda i, j, idx: (idx[i * 3 + j], 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i, j, idx: (i * 3 + j, 0)))
  x = jnp.ones((32, 128), jnp.float32)
  idx = jnp.array([0, 1, 2, 3, 9, 1], jnp.int32)
  msgs = {}
  for b in CPU_BACKENDS:
    f = pl.pallas_call(prefetch_kernel, jax.ShapeDtypeStruct((48, 128),
                                                             jnp.float32),
                       grid_spec=gs, backend=b)
    msgs[b] = _message(lambda: f(idx, x))
  assert len(set(msgs.values())) == 1, msgs
  assert ("in_specs[0]: block index (9, 0) at grid point (1, 1) is outside "
          "the array float32[32,128]" in msgs["interpret"])


def row_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[i_ref[0]][None, :]


def test_a_scalar_index_from_data(runtime_asserts):
  msgs = {}
  for b in CPU_BACKENDS:
    f = pl.pallas_call(row_kernel, jax.ShapeDtypeStruct((1, 128),
                                                        jnp.float32),
                       in_specs=[SMEM, None], backend=b)
    np.testing.assert_array_equal(f(jnp.array([3], jnp.int32), X), X[3:4])
    msgs[b] = _message(lambda: f(jnp.array([16], jnp.int32), X))
  assert len(set(msgs.values())) == 1, msgs
  assert "load from x_ref[16:17, :]" in msgs["interpret"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_scalar_index_outside_reads_poison(backend):
  f = pl.pallas_call(row_kernel, jax.ShapeDtypeStruct((1, 128), jnp.float32),
                     in_specs=[SMEM, None], backend=backend)
  for i in (16, -1, 1000):
    assert np.isnan(np.asarray(f(jnp.array([i], jnp.int32), X))).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_static_negative_index_counts_from_the_end(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(x_ref[-1] * 2, o_ref.shape)
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       backend=backend)(X)
  np.testing.assert_array_equal(got, np.broadcast_to(X[-1] * 2, (8, 128)))
