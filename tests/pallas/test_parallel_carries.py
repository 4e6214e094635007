"""A grid dim declared "parallel" that carries scratch from one step to the
next: a KernelError at trace time naming the dim and the scratch where the
kernel certainly reads it before writing it, a KernelWarning where it may;
nothing where a dim runs in order anyway or the scratch is written first."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas.testing import CPU_BACKENDS


def running_sum(x_ref, o_ref, acc_ref):
  acc_ref[...] += x_ref[...]
  o_ref[...] = acc_ref[...]


def running_sum_reset_under_when(x_ref, o_ref, acc_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  acc_ref[...] += x_ref[...]
  o_ref[...] = acc_ref[...]


def scratch_written_first(x_ref, o_ref, acc_ref):
  acc_ref[...] = x_ref[...] * 2
  o_ref[...] = acc_ref[...] + 1


def _call(kernel, sem, grid=(4,), backend="interpret"):
  rows = 8 * grid[0]
  spec = pl.BlockSpec((8, 128), lambda *ids: (ids[0], 0))
  params = pltpu.CompilerParams(dimension_semantics=sem) if sem else None
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((rows, 128), jnp.float32), grid=grid,
      in_specs=[spec], out_specs=spec,
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
      compiler_params=params, backend=backend)


X = jnp.ones((32, 128), jnp.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_parallel_dim_carrying_scratch_is_an_error(backend):
  with pytest.raises(pl.KernelError) as e:
    _call(running_sum, ("parallel",), backend=backend)(X)
  text = str(e.value)
  assert "grid dim 0 is declared \"parallel\"" in text
  assert "acc_ref" in text and "arbitrary" in text
  assert "test_parallel_carries.py:18" in text        # the first read


def test_names_every_parallel_dim():
  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = pl.pallas_call(
      running_sum, jax.ShapeDtypeStruct((32, 256), jnp.float32), grid=(4, 2),
      in_specs=[spec], out_specs=spec,
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel")))
  with pytest.raises(pl.KernelError, match="grid dims 0, 1 are declared"):
    f(jnp.ones((32, 256), jnp.float32))


def test_a_possible_carry_is_a_warning():
  with pytest.warns(pl.KernelWarning, match="may read acc_ref at each step"):
    _call(running_sum_reset_under_when, ("parallel",))(X)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sem", [("arbitrary",), None])
def test_dims_that_run_in_order_carry_scratch(backend, sem):
  with warnings.catch_warnings():
    warnings.simplefilter("error", pl.KernelWarning)
    out = _call(running_sum, sem, backend=backend)(X)
  want = np.repeat(np.arange(1, 5, dtype=np.float32), 8)[:, None] * np.ones(
      (1, 128), np.float32)
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scratch_written_first_on_a_parallel_dim(backend):
  with warnings.catch_warnings():
    warnings.simplefilter("error", pl.KernelWarning)
    out = _call(scratch_written_first, ("parallel",), backend=backend)(X)
  np.testing.assert_array_equal(out, np.full((32, 128), 3.0, np.float32))


def test_carry_along_a_reduction_axis_beside_a_parallel_dim():
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]
  x = jnp.ones((16, 4 * 128), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", pl.KernelWarning)
    out = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2, 4),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")))(x)
  np.testing.assert_array_equal(out, np.full((16, 128), 4.0, np.float32))


def _accumulate_over_dim(d):
  """Sums the x blocks along grid dim `d` into scratch, reset (written
  whole, by a `[:, :]` store as Pallas's flash attention backward writes
  its dk/dq scratch) when dim `d` starts over; the output block gets the
  running sum at every step."""
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(d) == 0)
    def _():
      acc_ref[:, :] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]
  return kernel


def _heads_call(kernel, grid, sem, backend):
  """x (heads, steps * 8, 128) on a grid (heads, steps), as flash
  attention's backward kernels have it: heads parallel, the reduction
  arbitrary; the output block of each step its own."""
  h, s = grid
  spec = pl.BlockSpec((None, 8, 128), lambda i, j: (i, j, 0))
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((h, s * 8, 128), jnp.float32), grid=grid,
      in_specs=[spec], out_specs=spec,
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=sem),
      backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("steps", [1, 3])
def test_scratch_reset_at_the_start_of_an_arbitrary_dim(backend, steps):
  """Reset whenever the arbitrary dim starts over, the scratch carries
  along that dim only, never along the parallel one before it, even where
  the arbitrary dim takes one step (no dim then runs in order): no
  warning, and each head gets its own running sum."""
  x = jnp.arange(2 * steps * 8 * 128, dtype=jnp.float32).reshape(
      2, steps * 8, 128)
  with warnings.catch_warnings():
    warnings.simplefilter("error", pl.KernelWarning)
    out = _heads_call(_accumulate_over_dim(1), (2, steps),
                      ("parallel", "arbitrary"), backend)(x)
  want = np.cumsum(np.asarray(x).reshape(2, steps, 8, 128), axis=1)
  np.testing.assert_array_equal(out, want.reshape(x.shape))


def test_a_reset_does_not_excuse_the_parallel_dim_it_resets_along():
  """Reset when the parallel dim 1 starts over, the scratch carries along
  dim 1: still a warning naming dim 1, though dim 0, before the reset dim,
  runs in order."""
  x = jnp.ones((2, 4 * 8, 128), jnp.float32)
  with pytest.warns(pl.KernelWarning, match="grid dim 1 is declared "
                    "\"parallel\", but the kernel may read acc_ref"):
    _heads_call(_accumulate_over_dim(1), (2, 4), ("arbitrary", "parallel"),
                "interpret")(x)
