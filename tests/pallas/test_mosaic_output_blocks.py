"""Output blocks on the Mosaic backends follow a TPU's grid pipeline: an
output block is never read from HBM (it starts as poison on
`mosaic_interpret`, as stale data on a TPU), and a return to an output
block already written back is an error: at trace time where the index maps
are static, at run time on `mosaic_interpret` where they read scalar
prefetch. Pallas's TPU interpret mode is the oracle. An aliased output that
the kernel may read (or write in part) before writing it whole starts from
its input, as on every backend (the Mosaic lowering copies the input's
block in: dsl/transforms/aliased_reads.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas import mosaic_golden as golden

MI = "mosaic_interpret"
F32 = jnp.float32


def _accumulate_without_init(x_ref, o_ref):
  o_ref[...] += x_ref[...]


def test_new_output_block_is_poison_not_hbm():
  x = jnp.ones((16, 128), F32)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  got = pl.pallas_call(_accumulate_without_init,
                       jax.ShapeDtypeStruct(x.shape, F32), grid=(2,),
                       in_specs=[spec], out_specs=spec, backend=MI)(x)
  assert np.isnan(np.asarray(got)).all()
  jpl = pytest.importorskip("jax.experimental.pallas")
  theirs = jpl.pallas_call(
      _accumulate_without_init, jax.ShapeDtypeStruct(x.shape, F32),
      grid=(2,), in_specs=[jpl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=jpl.BlockSpec((8, 128), lambda i: (i, 0)),
      interpret=pytest.importorskip(
          "jax.experimental.pallas.tpu").InterpretParams())(x)
  assert np.isnan(np.asarray(theirs)).all()


def _half_write(x_ref, o_ref):
  o_ref[:, :64] = x_ref[:, :64] * 2


def _aliased(kernel, x):
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32),
                        grid=(2,), in_specs=[spec], out_specs=spec,
                        input_output_aliases={0: 0}, backend=MI)(x)


def test_aliased_output_block_written_in_part_keeps_its_input():
  x = jnp.arange(16 * 128, dtype=F32).reshape(16, 128)
  got = np.asarray(_aliased(_half_write, x))
  np.testing.assert_array_equal(got[:, :64], np.asarray(x)[:, :64] * 2)
  # (Pallas's TPU interpreter writes stale data back there, a TPU too)
  np.testing.assert_array_equal(got[:, 64:], np.asarray(x)[:, 64:])


def test_aliased_output_reads_the_input_ref():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[:, :64] = x_ref[:, :64] * 2
  x = jnp.arange(16 * 128, dtype=F32).reshape(16, 128)
  want = np.asarray(x).copy()
  want[:, :64] *= 2
  np.testing.assert_array_equal(_aliased(kernel, x), want)


def test_aliased_output_copy_in_keeps_the_cost_estimate():
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  cost = pl.CostEstimate(flops=4096, transcendentals=0, bytes_accessed=16384)
  f = pl.pallas_call(_half_write, jax.ShapeDtypeStruct((16, 128), F32),
                     grid=(2,), in_specs=[spec], out_specs=spec,
                     input_output_aliases={0: 0}, cost_estimate=cost)
  (call,) = golden.lower_tpu(f, jnp.ones((16, 128), F32))
  assert call.module.count("transform_indices") == 3   # the input's copy
  assert call.config["custom_call_config"]["cost_estimate"] == {
      "flops": 4096, "transcendentals": 0, "bytes_accessed": 16384,
      "remote_bytes_transferred": 0}


def _revisiting_call(backend, out_map):
  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((16, 128), F32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(2, 2),
          in_specs=[pl.BlockSpec((8, 128), lambda i, j, s: (j, 0))],
          out_specs=pl.BlockSpec((8, 128), out_map)),
      backend=backend)


def test_revisit_read_from_scalar_prefetch_is_a_runtime_error():
  call = _revisiting_call(MI, lambda i, j, s: (s[j], 0))
  s = jnp.array([0, 1], jnp.int32)
  with pytest.raises(pl.KernelRuntimeError, match=(
      r"kernel 'kernel': out_specs\[0\]: output block \(0, 0\) is visited "
      r"again at grid point \(1, 0\) after it was visited at grid point "
      r"\(0, 0\) and written back.*innermost, or accumulate in scratch "
      r"\(at .*test_mosaic_output_blocks.py")):
    jax.block_until_ready(call(s, jnp.ones((16, 128), F32)))
  # Visited over consecutive steps only: fine.
  out = call(jnp.array([0, 0], jnp.int32), jnp.ones((16, 128), F32))
  np.testing.assert_array_equal(np.asarray(out)[:8], 1)


@pytest.mark.parametrize("backend", ("mosaic", MI))
def test_static_revisit_is_a_trace_time_error(backend):
  call = _revisiting_call(backend, lambda i, j, s: (j, 0))
  args = (jnp.array([0, 1], jnp.int32), jnp.ones((16, 128), F32))
  with pytest.raises(pl.KernelError, match=(
      r"out_specs\[0\]: its index map ignores grid dim 0 \(size 2\) but "
      r"depends on grid dim 1 \(size 2\) inside it.*block \(0, 0\) is "
      r"visited at grid point \(0, 0\), written back, and visited again at "
      r"grid point \(1, 0\).*accumulate in scratch "
      r"\(at .*test_mosaic_output_blocks.py")):
    jax.jit(call).trace(*args).lower(lowering_platforms=("tpu",))


def test_pallas_tpu_interpreter_refuses_the_same_revisit():
  # The oracle: Pallas's TPU interpreter raises on the kernel the Mosaic
  # backends refuse, and runs the one that visits blocks consecutively.
  jpl = pytest.importorskip("jax.experimental.pallas")
  jtpu = pytest.importorskip("jax.experimental.pallas.tpu")

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  def call(out_map):
    return jpl.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, 128), F32), grid=(2, 2),
        in_specs=[jpl.BlockSpec((8, 128), lambda i, j: (j, 0))],
        out_specs=jpl.BlockSpec((8, 128), out_map),
        interpret=jtpu.InterpretParams())
  x = jnp.ones((16, 128), F32)
  with pytest.raises(Exception, match="Revisited block"):
    jax.block_until_ready(call(lambda i, j: (j, 0))(x))
  np.testing.assert_array_equal(call(lambda i, j: (i, 0))(x), x)
