"""Named grid axes: `grid=(("i", 4), ("j", 2))` binds `i` and `j` in the
kernel body for `lax.axis_index`, `lax.axis_size` and `lax.psum` (of a value
the same along the axis), on every backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
import lowering_triton
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from dsl.core.errors import KernelError
from tests.pallas.testing import CPU_BACKENDS, array

BACKENDS = CPU_BACKENDS
GRID = (("i", 4), ("j", 2))
SPEC = pl.BlockSpec((8, 128), lambda i, j: (i, j))


def _named(kernel, backend, in_specs=(SPEC,), shape=(32, 256)):
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, jnp.float32),
                        grid=GRID, in_specs=list(in_specs), out_specs=SPEC,
                        backend=backend)


def _per_block(values):
  """A (32, 256) array holding values[i, j] in block (i, j)."""
  return jnp.repeat(jnp.repeat(jnp.asarray(values, jnp.float32), 8, 0), 128, 1)


def index_kernel(x_ref, o_ref):
  i, j = lax.axis_index("i"), lax.axis_index("j")
  cols = lax.psum(1, "j")                   # the axis size, as in shard_map
  rows = lax.axis_size("i")
  o_ref[...] = x_ref[...] + (i * cols + j + 100 * rows).astype(jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_axis_index_and_size_are_the_grid_position(backend):
  x = array(0, (32, 256), jnp.float32)
  got = jax.jit(_named(index_kernel, backend))(x)
  ids = np.arange(4)[:, None] * 2 + np.arange(2)[None, :] + 400
  np.testing.assert_allclose(got, x + _per_block(ids))


def test_axis_index_like_pallas_tpu_interpreter():
  x = array(0, (32, 256), jnp.float32)
  spec = jpl.BlockSpec((8, 128), lambda i, j: (i, j))
  theirs = jpl.pallas_call(index_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                           grid=GRID, in_specs=[spec], out_specs=spec,
                           interpret=jpltpu.InterpretParams())(x)
  np.testing.assert_allclose(_named(index_kernel, "interpret")(x), theirs)


def control_flow_kernel(x_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(lax.axis_index("j") == 1)
  def _():
    o_ref[...] = x_ref[...] + lax.axis_index("i").astype(jnp.float32)

  steps = lax.fori_loop(0, 3, lambda t, c: c + lax.axis_index("j"), 0)
  # x's block does not move along j: its sum over j is 2 * x.
  o_ref[...] += steps.astype(jnp.float32) + lax.psum(x_ref[...], "j")


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_axes_inside_when_and_loops(backend):
  x = array(1, (32, 256), jnp.float32)
  row = pl.BlockSpec((8, 128), lambda i, j: (i, 0))
  got = jax.jit(_named(control_flow_kernel, backend, (row,)))(x)
  xb = jnp.tile(x[:, :128], (1, 2))
  i = _per_block(np.repeat(np.arange(4)[:, None], 2, 1))
  j = _per_block(np.repeat(np.arange(2)[None, :], 4, 0))
  want = jnp.where(j == 1, xb + i, 0.0) + 3 * j + 2 * xb
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_jaxpr_has_program_ids_not_axis_names():
  spec = pl.pallas_call(index_kernel, jax.ShapeDtypeStruct((32, 256),
                                                           jnp.float32),
                        grid=GRID, in_specs=[SPEC], out_specs=SPEC)
  text = str(jax.make_jaxpr(spec)(jnp.zeros((32, 256))))
  assert "axis_index" not in text and "psum" not in text


def test_vmap_of_a_named_grid_kernel():
  x = array(2, (3, 32, 256), jnp.float32)
  f = _named(index_kernel, "interpret")
  got = jax.jit(jax.vmap(f))(x)
  want = jnp.stack([f(x[k]) for k in range(3)])
  np.testing.assert_allclose(got, want)


def test_triton_source_reads_the_program_id():
  x = jnp.zeros((32, 256), jnp.float32)
  (src,) = lowering_triton.to_source(_named(index_kernel, "triton"), x)
  assert "tl.program_id(0)" in src and "axis_index" not in src


def varying_psum_kernel(x_ref, o_ref):
  o_ref[...] = lax.psum(x_ref[...], "i")


def varying_pmax_kernel(x_ref, o_ref):
  o_ref[...] = lax.pmax(x_ref[...] + lax.axis_index("j"), "j")


@pytest.mark.parametrize("kernel,axis", [(varying_psum_kernel, "i"),
                                         (varying_pmax_kernel, "j")])
def test_collective_of_a_value_that_varies_is_a_trace_time_error(kernel, axis):
  with pytest.raises(KernelError) as e:
    _named(kernel, "interpret")(jnp.zeros((32, 256), jnp.float32))
  msg = str(e.value)
  assert kernel.__name__ in msg and f"axis {axis!r}" in msg
  assert "test_named_axes.py" in msg and "output block" in msg


def test_unsupported_collective_over_a_grid_axis_is_an_error():
  def gather_kernel(x_ref, o_ref):
    o_ref[...] = lax.all_gather(x_ref[...], "i", axis=0, tiled=True)[:8]
  with pytest.raises(KernelError, match="all_gather over the grid axis 'i'"):
    _named(gather_kernel, "interpret")(jnp.zeros((32, 256), jnp.float32))


def test_repeated_grid_names_are_rejected():
  with pytest.raises(KernelError, match="grid axis names must differ"):
    pl.pallas_call(index_kernel, jax.ShapeDtypeStruct((32, 256), jnp.float32),
                   grid=(("i", 4), ("i", 2)), in_specs=[SPEC],
                   out_specs=SPEC)(jnp.zeros((32, 256)))


def test_unnamed_grid_axis_is_still_unbound():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.axis_index("i")
  with pytest.raises(Exception, match="unbound axis name"):
    pl.pallas_call(k, jax.ShapeDtypeStruct((32, 256), jnp.float32),
                   grid=(4, 2), in_specs=[SPEC], out_specs=SPEC)(
                       jnp.zeros((32, 256)))


def test_grid_name_that_shadows_a_mesh_axis_is_rejected():
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
  call = pl.pallas_call(index_kernel, jax.ShapeDtypeStruct((32, 256),
                                                           jnp.float32),
                        grid=GRID, in_specs=[SPEC], out_specs=SPEC)
  f = jax.shard_map(call, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                    check_vma=False)
  with pytest.raises(KernelError, match="also an axis of the enclosing mesh"):
    jax.jit(f)(jnp.zeros((32, 256), jnp.float32))


def test_mesh_axis_beside_grid_names_keeps_its_meaning():
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

  def both_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.psum(1, ("x", "i")) + lax.axis_index("x")
  call = _named(both_kernel, "interpret")
  f = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  x = array(3, (32, 256), jnp.float32)
  np.testing.assert_allclose(jax.jit(f)(x), x + 4)
