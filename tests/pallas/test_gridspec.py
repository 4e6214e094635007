"""The operand layout every backend shares: GridMapping.split / KernelArgs,
and dimension_semantics checked against the grid at trace time."""
import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl.gridspec import KernelArgs
from tests.pallas.testing import CPU_BACKENDS


def _grid_mapping(n_pf=1, n_scratch=2, grid=(2, 3)):
  from dsl.pallas_call import build_spec
  blk = pl.BlockSpec((8, 128), lambda *a: (0, 0))

  def kernel(*refs):
    refs[n_pf + 2][...] = refs[n_pf][...] + refs[n_pf + 1][...]
  x = jnp.ones((8, 128))
  pf = tuple(jnp.arange(4, dtype=jnp.int32) for _ in range(n_pf))
  spec, _ = build_spec(
      kernel, pf + (x, x), jax.ShapeDtypeStruct(x.shape, x.dtype),
      name="k", grid=grid, in_specs=[blk, blk], out_specs=blk,
      scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)] * n_scratch,
      num_scalar_prefetch=n_pf)
  return spec


def test_split_refs_and_jaxpr_invars():
  spec = _grid_mapping()
  gm = spec.grid_mapping
  refs = list("pabosS")            # 1 prefetch, 2 inputs, 1 output, 2 scratch
  assert gm.split(refs) == KernelArgs((), ("p",), ("a", "b"), ("o",),
                                      ("s", "S"))
  invars = spec.jaxpr.jaxpr.invars
  parts = gm.split(invars)
  assert len(parts.ids) == 2 and parts.prefetch == tuple(invars[2:3])
  assert parts.outputs == (invars[5],) and len(parts.scratch) == 2


def test_split_operands_and_wrong_lengths():
  gm = _grid_mapping(n_pf=2, n_scratch=0).grid_mapping
  assert gm.split_operands([1, 2, 3, 4]) == KernelArgs((), (1, 2), (3, 4),
                                                       (), ())
  with pytest.raises(ValueError, match="operands"):
    gm.split([1, 2, 3])
  with pytest.raises(ValueError, match="operands"):
    gm.split_operands([1, 2, 3])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dimension_semantics_must_fit_the_grid(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.ones((16, 128))
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend,
      compiler_params=pl.tpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")))
  with pytest.raises(pl.KernelError, match="dimension_semantics has 2 "
                     "entries but the grid has rank 1") as info:
    call(x)
  assert "test_gridspec.py" in str(info.value)
