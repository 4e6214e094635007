"""`pl.kernel(body, out_type, mesh=...)`, JAX 0.11's mesh form: the body runs
once per core of a `TensorCoreMesh` with whole-array refs in `ANY` memory,
`lax.axis_index` of the mesh axis is the core; compared with jnp and with
Pallas's TPU interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.errors import BackendError, KernelError
from tests.pallas.testing import array

HOST = ["interpret", "mosaic_interpret"]
OUT = jax.ShapeDtypeStruct((16, 128), jnp.float32)


def dma_body(pl, pltpu):
  def double_kernel(x_hbm, o_hbm, buf, sem):
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    buf[...] = buf[...] * 2.0 + lax.axis_index("core").astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm)
  return double_kernel


def split_body(pl, pltpu):
  def split_kernel(x_hbm, o_hbm, buf):
    core = lax.axis_index("core")
    rows = pl.ds(core * 4, 4)
    pltpu.sync_copy(x_hbm.at[rows], buf)
    buf[...] += core.astype(jnp.float32) * lax.axis_size("core")

    @pltpu.run_on_first_core("core")
    def _():
      buf[...] = -buf[...]
    pltpu.sync_copy(buf, o_hbm.at[rows])
  return split_kernel


def _dma(pl, pltpu, **kw):
  return pl.kernel(dma_body(pl, pltpu), OUT,
                   mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=1),
                   scratch_types=[pltpu.VMEM((16, 128), jnp.float32),
                                  pltpu.SemaphoreType.DMA], **kw)


def _split(pl, pltpu, **kw):
  return pl.kernel(split_body(pl, pltpu), out_type=OUT,
                   mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=4),
                   scratch_types=[pltpu.VMEM((4, 128), jnp.float32)], **kw)


def _split_reference(x):
  core = jnp.repeat(jnp.arange(4.0), 4)[:, None]
  return (x + core * 4) * jnp.where(core == 0, -1.0, 1.0)


@pytest.mark.parametrize("backend", HOST)
def test_dma_into_vmem_scratch(backend):
  x = array(0, (16, 128), jnp.float32)
  got = jax.jit(_dma(pl, pltpu, backend=backend))(x)
  np.testing.assert_allclose(got, 2 * x, rtol=1e-6)
  theirs = _dma(jpl, jpltpu, interpret=jpltpu.InterpretParams())(x)
  np.testing.assert_allclose(got, theirs, rtol=1e-6)


@pytest.mark.parametrize("backend", HOST)
def test_cores_split_the_rows(backend):
  x = array(1, (16, 128), jnp.float32)
  got = jax.jit(_split(pl, pltpu, backend=backend))(x)
  np.testing.assert_allclose(got, _split_reference(x), rtol=1e-6)


def test_cores_split_the_rows_like_pallas_interpreter():
  x = array(1, (16, 128), jnp.float32)
  theirs = _split(jpl, jpltpu, interpret=jpltpu.InterpretParams())(x)
  np.testing.assert_allclose(theirs, _split_reference(x), rtol=1e-6)


def direct_kernel(x_ref, o_ref):
  core = lax.axis_index("c")
  o_ref[pl.ds(core * 8, 8), :] = x_ref[pl.ds(core * 8, 8), :] * 2.0


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_refs_are_whole_arrays_on_every_host_backend(backend):
  x = array(2, (16, 128), jnp.float32)
  mesh = pltpu.create_tensorcore_mesh("c", num_cores=2)
  f = pl.kernel(direct_kernel, OUT, mesh=mesh, backend=backend)
  np.testing.assert_allclose(jax.jit(f)(x), 2 * x)


def test_backend_limits_are_named():
  x = jnp.zeros((16, 128), jnp.float32)
  with pytest.raises(BackendError, match="semaphore"):
    _dma(pl, pltpu, backend="triton_interpret")(x)
  mesh = pltpu.create_tensorcore_mesh("c", num_cores=2)
  with pytest.raises(BackendError, match="pl.ANY"):
    pl.kernel(direct_kernel, OUT, mesh=mesh, backend="mosaic_interpret")(x)


def test_inputs_and_outputs_as_pytrees():
  def pair_kernel(xs, outs):
    outs["sum"][...] = xs[0][...] + xs[1][...]
    outs["diff"][...] = xs[0][...] - xs[1][...]
  a, b = array(3, (8, 128), jnp.float32), array(4, (8, 128), jnp.float32)
  s = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  f = pl.kernel(pair_kernel, out_shape={"sum": s, "diff": s},
                mesh=pltpu.create_tensorcore_mesh("c"))
  got = f((a, b))
  np.testing.assert_allclose(got["sum"], a + b)
  np.testing.assert_allclose(got["diff"], a - b)


def test_vmap_of_a_mesh_kernel():
  x = array(5, (3, 16, 128), jnp.float32)
  got = jax.vmap(_split(pl, pltpu))(x)
  np.testing.assert_allclose(got, jax.vmap(_split_reference)(x), rtol=1e-6)


def test_mesh_defaults_to_one_core_on_a_cpu():
  assert pltpu.create_tensorcore_mesh("core").num_cores == 1
  mesh = pltpu.TensorCoreMesh(axis_name="core")
  assert mesh.num_cores == 1 and mesh.core_type is pltpu.CoreType.TC
  assert dict(mesh.shape) == {"core": 1}
  with pytest.raises(ValueError, match="both"):
    pltpu.create_tensorcore_mesh("core", devices=jax.devices(), num_cores=1)


def test_core_barrier_of_one_core_is_free_and_of_more_an_error():
  def barrier_kernel(x_ref, o_ref, sem):
    pltpu.core_barrier(sem, core_axis_name="c")
    o_ref[...] = x_ref[...]
  x = array(6, (16, 128), jnp.float32)
  one = pl.kernel(barrier_kernel, OUT, mesh=pltpu.create_tensorcore_mesh("c"),
                  scratch_types=[pltpu.SemaphoreType.REGULAR])
  np.testing.assert_allclose(one(x), x)
  two = pl.kernel(barrier_kernel, OUT,
                  mesh=pltpu.create_tensorcore_mesh("c", num_cores=2),
                  scratch_types=[pltpu.SemaphoreType.REGULAR])
  with pytest.raises(KernelError, match="core_barrier over 2 cores") as e:
    two(x)
  assert "barrier_kernel" in str(e.value)


def test_bad_calls_are_named():
  mesh = pltpu.create_tensorcore_mesh("c")
  with pytest.raises(KernelError, match="not both"):
    pl.kernel(direct_kernel, OUT, out_shape=OUT, mesh=mesh)
  with pytest.raises(KernelError, match="takes no grid"):
    pl.kernel(direct_kernel, OUT, mesh=mesh, grid=(2,))

  class GPUMesh:
    num_threads = 2
  with pytest.raises(KernelError, match="GPU mesh") as e:
    pl.kernel(direct_kernel, OUT, mesh=GPUMesh())(jnp.zeros((16, 128)))
  assert "direct_kernel" in str(e.value) and "mesh" in str(e.value)


def test_grid_form_is_unchanged():
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (x.shape[0] // 8,), in_specs=[spec],
             out_specs=spec)
  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  x = array(7, (16, 128), jnp.float32)
  np.testing.assert_allclose(add_one(x), x + 1.0)


def test_mpmd_lists_are_rejected():
  mesh = pltpu.create_tensorcore_mesh("c")
  with pytest.raises(KernelError, match="MPMD"):
    pl.kernel([direct_kernel, direct_kernel], OUT, mesh=[mesh, mesh])
