"""What output memory holds before a kernel writes it, on every CPU backend:
poison where the kernel never writes (a grid that forgets `cdiv` leaves a
visibly wrong tail), the input where the output is aliased; and an aliased
output that the kernel reads before writing reads its input on every
backend, a TPU included (the Mosaic backends start such a block from the
aliased input). Checked against jnp and Pallas in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl as pl
from dsl.core.poison import poison_value
from tests.pallas import mosaic_golden
from tests.pallas.testing import CPU_BACKENDS


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _forgot_cdiv(pl_, x, rows, **kw):
  spec = pl_.BlockSpec((rows, 128), lambda i: (i, 0))
  return pl_.pallas_call(copy_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(x.shape[0] // rows,), in_specs=[spec],
                         out_specs=spec, **kw)(x)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.uint8])
def test_never_written_output_memory_is_poison(backend, dtype):
  rows = 32 if jnp.dtype(dtype).itemsize == 1 else 8   # TPU tiles
  x = jnp.ones((2 * rows + 4, 128), dtype)
  got = np.asarray(jax.jit(lambda x: _forgot_cdiv(pl, x, rows,
                                                  backend=backend))(x))
  np.testing.assert_array_equal(got[:2 * rows], np.ones((2 * rows, 128),
                                                        dtype))
  tail = np.full((4, 128), poison_value(dtype), dtype)
  np.testing.assert_array_equal(got[2 * rows:], tail)
  if dtype == jnp.float32:      # as Pallas: the tail is NaN there too
    theirs = np.asarray(_forgot_cdiv(jpl, x, rows, interpret=True))
    assert np.isnan(theirs[2 * rows:]).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_aliased_output_keeps_its_input_where_never_written(backend):
  x = jnp.arange(20 * 128, dtype=jnp.float32).reshape(20, 128)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(2,), in_specs=[spec], out_specs=spec,
                       input_output_aliases={0: 0}, backend=backend)(x)
  np.testing.assert_array_equal(got, np.concatenate([x[:16] * 2, x[16:]]))


def read_then_write(x_ref, y_ref, o_ref):
  o_ref[...] = o_ref[...] * 2 + 1


def _aliased(pl_, x, y, block, grid, **kw):
  spec = pl_.BlockSpec(block, lambda i, j: (i, j))
  return pl_.pallas_call(read_then_write, jax.ShapeDtypeStruct(x.shape,
                                                              x.dtype),
                         grid=grid, in_specs=[spec, spec], out_specs=spec,
                         input_output_aliases={0: 0}, **kw)(x, y)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape,block", [((1, 8), (1, 8)),
                                         ((16, 256), (8, 128))])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_aliased_output_read_before_written(backend, shape, block, dtype):
  x = (jnp.arange(np.prod(shape)) + 40).reshape(shape).astype(dtype)
  grid = (shape[0] // block[0], shape[1] // block[1])
  try:
    got = jax.jit(lambda x: _aliased(pl, x, x, block, grid,
                                     backend=backend))(x)
  except pl.KernelError as e:           # (1, 8) blocks break TPU tiling
    assert backend == "mosaic_interpret" and "tiling" in str(e).lower(), e
    return
  np.testing.assert_array_equal(got, x * 2 + 1)
  np.testing.assert_array_equal(got, _aliased(jpl, x, x, block, grid,
                                              interpret=True))


def test_the_fuzzer_case():
  """The case the differential fuzzer found: blocks of (1, 8), the index
  map `i * 2 + 0` (here on a one-step grid)."""
  def run(backend):
    spec = pl.BlockSpec((1, 8), lambda i, j: (i * 2 + 0, j))
    x = jnp.arange(40, 48, dtype=jnp.int32).reshape(1, 8)
    return pl.pallas_call(read_then_write, jax.ShapeDtypeStruct((1, 8),
                                                                jnp.int32),
                          grid=(1, 1), in_specs=[spec, spec], out_specs=spec,
                          input_output_aliases={0: 0}, backend=backend)(x, x)
  for b in CPU_BACKENDS:
    np.testing.assert_array_equal(run(b), [[81, 83, 85, 87, 89, 91, 93, 95]])


def test_the_tpu_kernel_starts_the_block_from_the_aliased_input():
  x = jax.ShapeDtypeStruct((16, 256), jnp.float32)
  f = lambda x: _aliased(pl, x, x, (8, 128), (2, 2), backend="mosaic")
  (call,) = mosaic_golden.lower_tpu(f, x)
  # one more operand (the aliased input, blocked as the output), copied
  # into the output block at the first visit of each block: every step of
  # this grid visits a new block, which is decided at trace time, so the
  # copy is unconditional
  assert "scf.if" not in call.module
  args = call.module.split("func.func @")[1].split("{", 1)[0]
  assert args.count("memref<8x128xf32") == 4, args


def written_first(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1
  o_ref[...] = o_ref[...] * 2


def test_outputs_written_before_read_are_not_rewritten():
  x = jax.ShapeDtypeStruct((16, 256), jnp.float32)
  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = lambda x: pl.pallas_call(written_first, x, grid=(2, 2),
                               in_specs=[spec], out_specs=spec,
                               input_output_aliases={0: 0},
                               backend="mosaic")(x)
  (call,) = mosaic_golden.lower_tpu(f, x)
  args = call.module.split("func.func @")[1].split("{", 1)[0]
  assert args.count("memref<8x128xf32") == 2, args
