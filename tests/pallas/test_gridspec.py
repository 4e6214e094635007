"""The operand layout every backend shares: GridMapping.split / KernelArgs,
and dimension_semantics checked against the grid at trace time."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

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


# --- optional operands: `None` with a `None` spec, as Pallas's kernels pass them

def _optional_kernel(x_ref, seg_ref, bias_ref, o_ref):
  v = x_ref[...]
  if seg_ref is not None:
    v = v + seg_ref[...]
  if bias_ref is not None:
    v = v * bias_ref[...]
  o_ref[...] = v


def _optional_call(mod, x, seg, bias, block, **kw):
  spec = mod.BlockSpec((block, x.shape[1]), lambda i: (i, 0))
  return mod.pallas_call(
      _optional_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(x.shape[0] // block,),
      in_specs=[spec, spec if seg is not None else None,
                spec if bias is not None else None],
      out_specs=spec, **kw)(x, seg, bias)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("present", ["none", "seg", "bias", "both"])
@pytest.mark.parametrize("shape,block,dtype", [((16, 128), 8, jnp.float32),
                                               ((32, 256), 16, jnp.bfloat16)])
def test_none_operands_with_none_specs_match_pallas(backend, present, shape,
                                                    block, dtype):
  x = (jnp.arange(shape[0] * shape[1]) % 7).reshape(shape).astype(dtype)
  seg = x + 1 if present in ("seg", "both") else None
  bias = x - 2 if present in ("bias", "both") else None
  got = _optional_call(pl, x, seg, bias, block, backend=backend)
  want = _optional_call(jpl, x, seg, bias, block, interpret=True)
  ref = x if seg is None else x + seg
  ref = ref if bias is None else ref * bias
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(ref, np.float32))


def test_none_spec_of_an_array_operand_is_the_whole_array_beside_none_operands():
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  w = jnp.arange(128, dtype=jnp.float32)

  def kernel(x_ref, w_ref, none_ref, o_ref):
    assert none_ref is None
    o_ref[...] = x_ref[...] * w_ref[...]
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape,
                                                              x.dtype),
                       grid=(2,), in_specs=[spec, None, None],
                       out_specs=spec)(x, w, None)
  np.testing.assert_array_equal(got, x * w)


def test_specs_that_match_neither_layout_name_the_counts():
  x = jnp.ones((16, 128))
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  with pytest.raises(pl.KernelError, match=r"in_specs has 3 BlockSpecs but "
                     r"there are 2 inputs"):
    pl.pallas_call(lambda a, b, o: None,
                   out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                   grid=(2,), in_specs=[spec, spec, spec],
                   out_specs=spec)(x, x)
