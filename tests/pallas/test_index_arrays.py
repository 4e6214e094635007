"""Arrays of indices inside kernels follow JAX's indexing, on every backend
that takes them: negative indices count from the end, indices still outside
are clamped on reads (as JAX clamps a gather's) and dropped on writes (as
JAX drops a scatter's), and either is reported with
jax_pallas_enable_runtime_assert. Windows (`pl.ds`) keep their poison."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import triton as jpl_triton

import dsl as pl
from dsl import triton as plt

X = jnp.arange(8 * 8, dtype=jnp.float32).reshape(8, 8)
C = np.array([1, 0, 2, 2, -1, 1])
# the backends that take arrays of indices (Mosaic refuses gathers, as TPUs)
GATHER_BACKENDS = ("interpret", "triton_interpret")
READS = {
    "c_c": lambda r: r[C, C],                      # interpret only
    "c_step3": lambda r: r[C, ::3],
    "step3_c": lambda r: r[::3, C],
    "past_end": lambda r: r[:, np.array([0, 7, 9, 100])],
    "before_start": lambda r: r[np.array([-1, -8, -9, -50]), :],
    "rows_by_cols": lambda r: r[np.array([0, 7, 9, -1])[:, None],
                                np.array([2, -3, 5])[None, :]],
    "square": lambda r: r[np.array([[0, 1], [9, -2]]),
                          np.array([[3, 3], [-1, 0]])],
}


def _read(mod, fn, x, **kw):
  want = jax.eval_shape(fn, x)

  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref)
  return mod.pallas_call(kernel, out_shape=want, **kw)(x)


READ_CASES = [(b, c) for b in GATHER_BACKENDS for c in sorted(READS)]


@pytest.mark.parametrize("backend,case", READ_CASES)
def test_reads_follow_jax(backend, case):
  fn = READS[case]
  got = _read(pl, fn, X, backend=backend)
  np.testing.assert_array_equal(got, fn(X))


@pytest.mark.parametrize("backend", GATHER_BACKENDS)
def test_indices_read_from_a_ref_match_pallas(backend):
  idx = jnp.array([3, -1, 9, -9, 0], jnp.int32)

  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[i_ref[...], :]
  shape = jax.ShapeDtypeStruct((5, 8), jnp.float32)
  got = pl.pallas_call(kernel, out_shape=shape, backend=backend)(idx, X)
  want = jpl.pallas_call(kernel, out_shape=shape, interpret=True)(idx, X)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, X[idx])


@pytest.mark.parametrize("backend", GATHER_BACKENDS)
def test_writes_wrap_negative_indices_and_drop_the_ones_outside(backend):
  idx = jnp.array([-1, 0, 9, -20], jnp.int32)

  def kernel(i_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[i_ref[...]] = jnp.arange(4, dtype=jnp.float32) + 1
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,),
                                                              jnp.float32),
                       backend=backend)(idx)
  want = jnp.zeros(8).at[idx].set(jnp.arange(4.0) + 1)   # JAX drops 9, -20
  np.testing.assert_array_equal(got, want)


def _tile_kernel(pl, plt):
  """Rows and columns of a tile, each an array of indices broadcast against
  the other (masked where they leave the array), for a load and a store:
  the pattern of Pallas's GPU norms' backward."""
  def kernel(x_ref, o_ref):
    rows = 4 * pl.program_id(0) + jnp.arange(4)
    cols = jnp.arange(8)
    mask = (rows[:, None] < 6) & (cols[None, :] < 6)
    tile = plt.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask,
                    other=0.0)
    plt.store(o_ref.at[rows[:, None], cols[None, :]], tile + 1.0, mask=mask)
  return kernel


@pytest.mark.parametrize("backend", GATHER_BACKENDS)
def test_arrays_of_indices_on_two_dims_read_and_write_as_pallas(backend):
  x = jnp.arange(6 * 6, dtype=jnp.float32).reshape(6, 6)
  shape = jax.ShapeDtypeStruct((6, 6), jnp.float32)
  got = pl.pallas_call(_tile_kernel(pl, plt), out_shape=shape, grid=(2,),
                       backend=backend)(x)
  want = jpl.pallas_call(_tile_kernel(jpl, jpl_triton), out_shape=shape,
                         grid=(2,), interpret=True)(x)
  np.testing.assert_array_equal(got, x + 1)
  np.testing.assert_array_equal(got, want)


def _gather(backend, idx):
  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[i_ref[...]]
  x = jnp.arange(8, dtype=jnp.float32)
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(idx.shape,
                                                               jnp.float32),
                        backend=backend)(idx, x)


@pytest.mark.parametrize("backend", GATHER_BACKENDS)
def test_runtime_asserts_report_clamped_indices_not_negative_ones(
    backend, runtime_asserts):
  inside = jnp.array([-1, -8, 0, 7], jnp.int32)
  np.testing.assert_array_equal(_gather(backend, inside), [7, 0, 0, 7])
  with pytest.raises(pl.KernelCheckError, match="out-of-bounds load from "
                     r"x_ref\[indices"):
    jax.block_until_ready(_gather(backend, jnp.array([0, 9, 1, 2],
                                                     jnp.int32)))
