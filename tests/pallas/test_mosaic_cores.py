"""The TensorCores of a chip on `mosaic_interpret`: one by default, two (a
megacore chip) with `interpreter_options(num_cores=2)`, which split the
leading "parallel" grid dims between them, each core with its own SMEM.
Compared with Pallas's TPU interpret mode on as many cores
(`InterpretParams(num_cores_or_threads=...)`) and with the `interpret`
backend, which gives each parallel grid point its own state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.errors import KernelRuntimeError, kernel_error_of
from lowering_mosaic import KernelRaceError, interpreter_options
from lowering_mosaic.verification import interpreter


def _pallas(cores):
  return jpltpu.InterpretParams(num_cores_or_threads=cores)


# ------------------------------------------------------------ a DMA chain

def _prefetching_copy(lib, tpu, nj, **call):
  """x * 2, one 8-row block per grid point (i, j), "parallel" over i. Each
  run of j prefetches its next block, and only its first point (where the
  SMEM flag, a scalar-prefetch operand, is still 1) starts its own: the
  pattern of Pallas's paged attention in megacore mode. On one core the
  second run of j finds the flag cleared and waits for a DMA nobody
  started."""
  def kernel(flag_ref, x_hbm, o_ref, buf, sem):
    i, j = lib.program_id(0), lib.program_id(1)
    row = i * nj + j
    copy = lambda r: tpu.make_async_copy(x_hbm.at[lib.ds(r * 8, 8)], buf,
                                         sem)

    @lib.when(flag_ref[0] == 1)
    def _():
      copy(row).start()
    flag_ref[0] = 0
    copy(row).wait()
    o_ref[...] = buf[...] * 2

    @lib.when(j + 1 < nj)
    def _():
      copy(row + 1).start()

  def f(x):
    spec = tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(2, nj),
        in_specs=[lib.BlockSpec(memory_space=lib.ANY)],
        out_specs=lib.BlockSpec((8, 128), lambda i, j, f: (i * nj + j, 0)),
        scratch_shapes=[tpu.VMEM((8, 128), jnp.float32),
                        tpu.SemaphoreType.DMA])
    return lib.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=spec, compiler_params=tpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")),
        **call)(jnp.ones((1,), jnp.int32), x)
  return f


def _x(nj):
  return jnp.arange(2 * nj * 8 * 128, dtype=jnp.float32).reshape(-1, 128)


def test_each_core_of_a_megacore_chip_has_its_own_smem():
  x = _x(3)
  with interpreter_options(num_cores=2):
    ours = _prefetching_copy(pl, pltpu, 3, backend="mosaic_interpret")(x)
  np.testing.assert_array_equal(ours, 2 * x)
  np.testing.assert_array_equal(
      _prefetching_copy(pl, pltpu, 3, backend="interpret")(x), 2 * x)


@pytest.mark.slow
def test_the_megacore_dma_chain_agrees_with_pallas_on_two_cores():
  x = _x(3)
  with interpreter_options(num_cores=2):
    ours = _prefetching_copy(pl, pltpu, 3, backend="mosaic_interpret")(x)
  theirs = _prefetching_copy(jpl, jpltpu, 3, interpret=_pallas(2))(x)
  np.testing.assert_array_equal(ours, theirs)


def test_one_core_by_default_runs_the_whole_grid_on_one_smem():
  f = _prefetching_copy(pl, pltpu, 3, backend="mosaic_interpret")
  interpreter.clear_reports()
  with pytest.raises(Exception) as e:
    jax.block_until_ready(f(_x(3)))
  assert isinstance(kernel_error_of(e.value), KernelRuntimeError)
  err = interpreter.last_failure()
  assert err.kind == "deadlock" and "can never finish" in str(err)


# ------------------------------------------------------------ the split

def _counter(lib, tpu, grid, semantics, **call):
  """Each grid point writes how many points its core ran before it: a
  count kept in SMEM (a scalar-prefetch operand the kernel writes)."""
  def kernel(count_ref, o_ref):
    n = count_ref[0]
    count_ref[0] = n + 1
    o_ref[...] = jnp.full(o_ref.shape, n, jnp.int32)

  def f(start):
    spec = tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=[],
        out_specs=lib.BlockSpec((None,) * len(grid) + (8, 128),
                                lambda *ids: ids[:len(grid)] + (0, 0)))
    return lib.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(grid + (8, 128), jnp.int32),
        grid_spec=spec, compiler_params=tpu.CompilerParams(
            dimension_semantics=semantics), **call)(start)
  return f


def _expected_counts(grid, n_split, cores):
  """Points of the leading `n_split` dims cut into `cores` consecutive
  shares of ceil(points / cores); each core counts its points from 0."""
  outer = int(np.prod(grid[:n_split]))
  inner = int(np.prod(grid[n_split:]))
  share = -(-outer // cores)
  flat = np.arange(outer * inner)
  return (flat - (flat // inner // share) * share * inner).reshape(grid)


GRIDS = [((2, 4), ("parallel", "arbitrary"), 1),
         ((3, 2), ("parallel", "arbitrary"), 1),        # uneven: 2 + 1
         ((2, 3, 2), ("parallel", "parallel", "arbitrary"), 2),
         ((3, 2), ("core_parallel", "arbitrary"), 1),
         ((4,), ("arbitrary",), 0)]                      # nothing to split


def _counts(grid, semantics, cores):
  with interpreter_options(num_cores=cores):
    return _counter(pl, pltpu, grid, semantics, backend="mosaic_interpret")(
        jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("grid,semantics,n_split", GRIDS)
def test_cores_split_the_leading_parallel_dims(grid, semantics, n_split,
                                               cores):
  want = _expected_counts(grid, n_split if cores > 1 else 0, cores)
  np.testing.assert_array_equal(_counts(grid, semantics, cores)[..., 0, 0],
                                want)


def test_the_cores_apply_to_a_kernel_already_called():
  f = _counter(pl, pltpu, (2, 2), ("parallel", "arbitrary"),
               backend="mosaic_interpret")
  jitted = jax.jit(f)
  start = jnp.zeros((1,), jnp.int32)
  for g in (f, jitted):
    np.testing.assert_array_equal(g(start)[..., 0, 0], [[0, 1], [2, 3]])
    with interpreter_options(num_cores=2):
      np.testing.assert_array_equal(g(start)[..., 0, 0], [[0, 1], [0, 1]])


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("grid,semantics,cores", [
    ((3, 2), ("parallel", "arbitrary"), 2),
    pytest.param((3, 2), ("parallel", "arbitrary"), 1, marks=_SLOW),
    pytest.param((2, 4), ("parallel", "arbitrary"), 2, marks=_SLOW),
    pytest.param((2, 3, 2), ("parallel", "parallel", "arbitrary"), 2,
                 marks=_SLOW)])
def test_the_split_agrees_with_pallas(grid, semantics, cores):
  ours = _counts(grid, semantics, cores)
  # Pallas's interpret mode visits the points of parallel dims in a shuffled
  # order (a TPU, and mosaic_interpret, in row-major order): the counts its
  # cores reach agree as a multiset, which the sizes of the shares decide.
  theirs = _counter(jpl, jpltpu, grid, semantics,
                    interpret=_pallas(cores))(jnp.zeros((1,), jnp.int32))
  np.testing.assert_array_equal(np.sort(ours, axis=None),
                                np.sort(theirs, axis=None))


# ------------------------------------------------------------ races

def _same_block_on_every_point(**call):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      backend="mosaic_interpret", **call)


def test_two_cores_writing_back_one_output_block_race():
  x = jnp.zeros((8, 128), jnp.float32)
  f = _same_block_on_every_point()
  np.testing.assert_array_equal(f(x), x + 1)     # one core: a revisit
  interpreter.clear_reports()
  with interpreter_options(num_cores=2), pytest.raises(Exception):
    jax.block_until_ready(_same_block_on_every_point()(x))
  err = interpreter.last_failure()
  assert isinstance(err, KernelRaceError), err
  assert "out_specs[0]" in str(err) and "core 0" in str(err) \
      and "core 1" in str(err)
  assert any(line and "test_mosaic_cores.py" in line for line in err.lines)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_num_cores_is_a_positive_int(bad):
  with pytest.raises(ValueError, match="num_cores"):
    with interpreter_options(num_cores=bad):
      pass
