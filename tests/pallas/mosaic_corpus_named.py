"""Golden corpus: named grid axes (`grid=(("i", 4), ...)` with
`lax.axis_index` and `lax.psum` of the axis size in the body) and kernels
over a mesh of TensorCores (`pl.kernel(mesh=...)`); see mosaic_corpus.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tests.pallas.mosaic_corpus import case, f32, sds


@case
def named_grid_axis_index(pl, pltpu):
  def named_kernel(x_ref, o_ref):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    n = lax.psum(1, "j")
    o_ref[...] = x_ref[...] + (i * n + j).astype(jnp.float32)
  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = pl.pallas_call(named_kernel, sds((32, 256)), grid=(("i", 4), ("j", 2)),
                     in_specs=[spec], out_specs=spec,
                     compiler_params=pltpu.CompilerParams(
                         dimension_semantics=("parallel", "arbitrary")))
  return f, (f32(32, 256),)


@case
def named_grid_in_control_flow(pl, pltpu):
  def named_when_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

    @pl.when(lax.axis_index("j") == lax.axis_size("j") - 1)
    def _():
      o_ref[...] += lax.axis_index("i").astype(jnp.float32)
  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = pl.pallas_call(named_when_kernel, sds((16, 256)),
                     grid=(("i", 2), ("j", 2)), in_specs=[spec],
                     out_specs=spec)
  return f, (f32(16, 256),)


def _mesh_dma_body(pl, pltpu):
  def mesh_dma_kernel(x_hbm, o_hbm, buf, sem):
    core = lax.axis_index("core")
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    buf[...] = buf[...] * 2.0 + core.astype(jnp.float32)
    pltpu.sync_copy(buf, o_hbm)
  return mesh_dma_kernel


@case
def mesh_kernel_dma(pl, pltpu):
  f = pl.kernel(_mesh_dma_body(pl, pltpu), sds((16, 128)),
                mesh=pltpu.create_tensorcore_mesh("core", num_cores=1),
                scratch_types=[pltpu.VMEM((16, 128), jnp.float32),
                               pltpu.SemaphoreType.DMA])
  return f, (f32(16, 128),)


@case
def mesh_kernel_first_core(pl, pltpu):
  @pl.kernel(out_type=(sds((8, 128)), sds((8, 128))),
             mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=1),
             scratch_types=(pltpu.VMEM((8, 128), jnp.float32),))
  def mesh_two_outputs(x_hbm, o_hbm, p_hbm, buf):
    pltpu.sync_copy(x_hbm, buf)

    @pltpu.run_on_first_core("core")
    def _():
      buf[...] += 1.0
    pltpu.sync_copy(buf, o_hbm)
    pltpu.sync_copy(buf, p_hbm)
  return mesh_two_outputs, (f32(8, 128),)


@case
def named_grid_vmapped(pl, pltpu):
  def named_vmapped_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * lax.axis_size("i") + lax.axis_index(
        "i").astype(jnp.float32)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(named_vmapped_kernel, sds((16, 128)), grid=(("i", 2),),
                     in_specs=[spec], out_specs=spec)
  return jax.vmap(f), (f32(3, 16, 128),)
