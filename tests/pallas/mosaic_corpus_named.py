"""Golden corpus: named grid axes (`grid=(("i", 4), ...)` with
`lax.axis_index` and `lax.psum` of the axis size in the body) and kernels
over a mesh of TensorCores (`pl.kernel(mesh=...)`); see mosaic_corpus.py.
"""
from __future__ import annotations

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
