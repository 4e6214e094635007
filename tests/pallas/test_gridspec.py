"""The operand layout every backend shares: GridMapping.split / KernelArgs,
and dimension_semantics checked against the grid at trace time."""
import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl.core.gridspec import KernelArgs
from tests.pallas.testing import CPU_BACKENDS


def _grid_mapping(n_pf=1, n_scratch=2, grid=(2, 3)):
  from dsl.core.pallas_call import build_spec
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


def test_grid_model_answers_per_operand():
  """The grid model answers what every backend asks of an operand: its
  block indices at each grid point, whether they move along a dim, whether
  the index map reads scalar prefetch, the execution plan, ref avals and
  labels."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.ones((16, 256))
  from dsl.core.pallas_call import build_spec
  spec, _ = build_spec(
      kernel, (x,), jax.ShapeDtypeStruct((16, 128), x.dtype), name="k",
      grid=(2, 2), in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, 0)))
  gm = spec.grid_mapping
  x_bm, o_bm = gm.block_mappings
  assert gm.block_indices(x_bm).tolist() == [[[0, 0], [0, 1]],
                                             [[1, 0], [1, 1]]]
  assert gm.moves_along(x_bm, 1) and not gm.moves_along(o_bm, 1)
  assert gm.moves_along(o_bm, 0) and not gm.reads_prefetch(x_bm)
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  assert plan.parallel == (0,) and plan.sequential == (1,)
  assert gm.ref_origins == ("in_specs[0]", "out_specs[0]")
  assert [a.shape for a in gm.ref_avals] == [(8, 128), (8, 128)]
  assert spec.ref_labels() == ["x_ref", "o_ref"]


def test_grid_model_prefetch_maps_have_no_static_answer():
  spec = _grid_mapping(n_pf=1, n_scratch=1)
  gm = spec.grid_mapping
  assert gm.ref_origins[0] == "scalar prefetch 0"
  assert gm.ref_origins[-1] == "scratch_shapes[0]"
  from dsl.core.pallas_call import build_spec
  x = jnp.ones((16, 128))

  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
  spec, _ = build_spec(
      kernel, (jnp.arange(2, dtype=jnp.int32), x),
      jax.ShapeDtypeStruct(x.shape, x.dtype), name="k", grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0)),
      num_scalar_prefetch=1)
  gm = spec.grid_mapping
  x_bm, o_bm = gm.block_mappings
  assert gm.reads_prefetch(x_bm) and not gm.reads_prefetch(o_bm)
  assert gm.block_indices(x_bm) is None and gm.moves_along(x_bm, 0) is None
  assert gm.block_indices(o_bm).tolist() == [[0, 0], [1, 0]]


def test_grid_mapping_checks_its_invariants():
  import dataclasses
  gm = _grid_mapping().grid_mapping
  with pytest.raises(ValueError, match="3 block mappings for 1 inputs"):
    dataclasses.replace(gm, num_inputs=1)
  with pytest.raises(ValueError, match="prefetch avals"):
    dataclasses.replace(gm, num_scalar_prefetch=0)
  with pytest.raises(ValueError, match="index map takes 3 arguments"):
    dataclasses.replace(gm, grid=(2,))
  with pytest.raises(ValueError, match="hidden axes"):
    dataclasses.replace(gm, num_hidden_axes=3)
