"""Grid steps that store apart (dsl.core.disjoint_writes): a grid dim that
the plan runs in order only because every step stores to the same whole
output runs as parallel programs on Triton where dsl proves the steps store
to disjoint elements and read none of the output; anything less stays in
order. Either way the numbers are those of jnp and of Pallas."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
import lowering_triton
from dsl import triton as plt
from dsl.core.disjoint_writes import disjoint_write_dims
from lowering_triton.aot import kernel_specs
from tests.pallas.testing import array, assert_close

with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import triton as jpl_triton

S = jax.ShapeDtypeStruct
ROWS, COLS, BLOCK = 32, 100, 16
GRID = (pl.cdiv(COLS, BLOCK),)


def _column_sums(pl, plt, width=BLOCK):
  """Each program sums `width` columns from `BLOCK * program_id` of a whole
  (row, col) array into a whole output vector, masked at its end (the
  pattern of Pallas's GPU layer norm's dw/db kernel)."""
  def kernel(x_ref, o_ref):
    cols = pl.program_id(0) * BLOCK + jnp.arange(width)
    mask = cols < COLS
    rows = jnp.arange(ROWS)
    x = plt.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask[None, :],
                 other=0.0)
    plt.store(o_ref.at[cols], x.sum(axis=0), mask=mask)
  return kernel


def _call(kernel, backend=None, pallas=False):
  out = S((COLS,), jnp.float32)
  if pallas:
    return lambda x: jpl.pallas_call(kernel, out_shape=out, grid=GRID,
                                     interpret=True)(x)
  return lambda x: pl.pallas_call(kernel, out_shape=out, grid=GRID,
                                  backend=backend)(x)


def _accumulate(x_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += x_ref[0, :]


def _overwrite(x_ref, o_ref):
  o_ref[...] = x_ref[0, :] + pl.program_id(0).astype(jnp.float32)


KERNELS = {
    "apart": (_column_sums(pl, plt), (0,)),
    # windows of 32 columns every 16: neighbours overlap
    "overlapping": (_column_sums(pl, plt, width=32), ()),
    "reads_the_output": (_accumulate, ()),
    "stores_all_of_it": (_overwrite, ()),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_only_steps_proven_apart_run_as_parallel_programs(name):
  kernel, dims = KERNELS[name]
  x = S((ROWS, COLS), jnp.float32)
  (spec,) = kernel_specs(_call(kernel, "triton"), x)
  assert disjoint_write_dims(spec) == dims
  (src,) = lowering_triton.to_source(_call(kernel, "triton"), x)
  launch = f"# launch grid ({GRID[0]}, 1, 1)" if dims else \
      "# launch grid (1, 1, 1)"
  assert launch in src
  assert ("sequential grid dims run in order" in src) == (not dims)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_parallel_or_not_the_numbers_are_those_of_the_steps_in_order(name):
  kernel, _ = KERNELS[name]
  x = array(0, (ROWS, COLS), jnp.float32)
  got = jax.jit(_call(kernel, "triton_interpret"))(x)
  want = jax.jit(_call(kernel, "interpret"))(x)
  assert_close(got, want)
  if name == "apart":
    assert_close(got, x.sum(axis=0))
    peer = jax.jit(_call(_column_sums(jpl, jpl_triton), pallas=True))(x)
    assert_close(got, peer)


def test_an_output_aliased_to_an_input_keeps_the_steps_in_order():
  x = S((COLS,), jnp.float32)

  def kernel(x_ref, o_ref):
    cols = pl.program_id(0) * BLOCK + jnp.arange(BLOCK)
    plt.store(o_ref.at[cols], plt.load(x_ref.at[cols], mask=cols < COLS)
              * 2.0, mask=cols < COLS)
  f = lambda x: pl.pallas_call(kernel, out_shape=x, grid=GRID,
                               input_output_aliases={0: 0},
                               backend="triton")(x)
  (spec,) = kernel_specs(f, x)
  assert disjoint_write_dims(spec) == ()
  got = jax.jit(lambda x: pl.pallas_call(
      kernel, out_shape=x, grid=GRID, input_output_aliases={0: 0},
      backend="triton_interpret")(x))(jnp.arange(COLS, dtype=jnp.float32))
  np.testing.assert_array_equal(got, 2 * np.arange(COLS))
