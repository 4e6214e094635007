"""Where a kernel's operands sit (dsl.core.kernel_layout.KernelLayout): the
grid mapping's layouts, the layout a Mosaic module's attributes give, and
derived kernels that add groups of their own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.inspection import traced_kernels
from dsl.core.kernel_layout import KernelLayout
from dsl.transforms.jvp import jvp_spec
from lowering_mosaic import dialect
from lowering_mosaic.tpu.mlir_modules import to_modules


def test_split_locate_and_groups_of_a_layout():
  layout = KernelLayout.of(prefetch=1, inputs=2, outputs=1)
  assert layout.split("abcd") == (("a",), ("b", "c"), ("d",))
  assert layout.split("abcd").inputs == ("b", "c")
  assert layout.total == 4
  assert [layout.locate(i) for i in range(4)] == [
      ("prefetch", 0), ("inputs", 0), ("inputs", 1), ("outputs", 0)]
  assert layout.positions("inputs") == range(1, 3)
  grown = layout.insert("inputs", tangents=2)
  assert grown.names == ("prefetch", "inputs", "tangents", "outputs")
  assert grown.start("outputs") == 5
  assert grown.only("inputs", "outputs").split("xyz") == (("x", "y"), ("z",))


def test_a_group_of_the_rest_takes_what_the_others_leave():
  layout = KernelLayout.of(outputs=2, errors=None)
  assert layout.split(range(5)) == ((0, 1), (2, 3, 4))
  assert layout.split(range(2)).errors == ()
  assert layout.locate(3, total=5) == ("errors", 1)
  with pytest.raises(ValueError, match="1 operands"):
    layout.split(range(1))


@pytest.mark.parametrize("bad, match", [
    (lambda: KernelLayout.of(a=None, b=None), "more than one group"),
    (lambda: KernelLayout.of(a=-1), "negative"),
    (lambda: KernelLayout((("a", 1), ("a", 2))), "twice"),
    (lambda: KernelLayout.of(a=1).split("ab"), "2 operands"),
])
def test_inconsistent_layouts_are_refused(bad, match):
  with pytest.raises(ValueError, match=match):
    bad()


def test_unknown_groups_and_positions_are_refused():
  layout = KernelLayout.of(inputs=1)
  with pytest.raises(KeyError, match="scratch"):
    layout.start("scratch")
  with pytest.raises(IndexError, match="operand 1"):
    layout.locate(1)


def _prefetch_kernel(idx_ref, x_ref, y_ref, o_ref, acc_ref):
  acc_ref[...] = x_ref[...] * y_ref[...]
  o_ref[...] = acc_ref[...] + x_ref[...] + idx_ref[0].astype(jnp.float32)


def _prefetch_call(lib, idx, x, y, **kw):
  """The kernel through dsl (`lib` pltpu) or Pallas (`lib` jpltpu)."""
  call_lib = pl if lib is pltpu else jpl
  spec = lambda i, idx: (idx[0] * 0 + i, 0)
  grid_spec = lib.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(2,),
      in_specs=[call_lib.BlockSpec((8, 128), spec),
                call_lib.BlockSpec((8, 128), spec)],
      out_specs=call_lib.BlockSpec((8, 128), spec),
      scratch_shapes=[lib.VMEM((8, 128), jnp.float32)])
  return call_lib.pallas_call(
      _prefetch_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid_spec=grid_spec, input_output_aliases={2: 0}, **kw)(idx, x, y)


def _operands():
  idx = jnp.array([3], jnp.int32)
  x = jnp.linspace(-1, 1, 16 * 128, dtype=jnp.float32).reshape(16, 128)
  return idx, x, jnp.cos(x)


def test_grid_mapping_layouts_name_the_kernels_groups():
  idx, x, y = _operands()
  (spec, _), = traced_kernels(lambda *a: _prefetch_call(pltpu, *a), idx, x,
                              y)
  gm = spec.grid_mapping
  assert gm.ref_layout() == KernelLayout.of(ids=0, prefetch=1, inputs=2,
                                            outputs=1, scratch=1)
  assert gm.ref_layout(ids=True).split(spec.jaxpr.jaxpr.invars) == (
      gm.split(spec.jaxpr.jaxpr.invars)[:5])
  assert gm.call_layout().names == ("sizes", "prefetch", "inputs")
  assert gm.aliased_operand(2) == ("inputs", 1)
  assert gm.aliased_operand(0) == ("prefetch", 0)
  assert gm.block_layout().split(gm.block_mappings) == (
      gm.in_mappings, gm.out_mappings)
  # jvp's operands: prefetch, inputs, their tangents; outputs: the output,
  # its tangent. The aliased input's tangent is aliased to the output's.
  assert dict(jvp_spec(spec, (True, True)).input_output_aliases) == {
      2: 0, 4: 1}
  assert dict(jvp_spec(spec, (False, True)).input_output_aliases) == {
      2: 0, 3: 1}


def test_a_mosaic_entrys_attributes_give_the_kernels_layout():
  idx, x, y = _operands()
  f = lambda *a: _prefetch_call(pltpu, *a)
  (module,) = to_modules(f, idx, x, y)
  (spec, _), = traced_kernels(f, idx, x, y)
  main = next(op for op in module.body.operations
              if "scalar_prefetch" in op.attributes)
  attrs = {name: main.attributes[name] for name in main.attributes}
  n_refs = (len(main.regions[0].blocks[0].arguments)
            - len(spec.grid_mapping.grid))
  want = spec.grid_mapping.ref_layout().only("prefetch", "inputs", "outputs",
                                              "scratch")
  assert dialect.entry_layout(attrs, n_refs) == want
  # A module lowered elsewhere: every operand but the last is an input.
  del attrs["dsl.num_inputs"]
  assert dialect.entry_layout(attrs, n_refs) == want
  attrs["scratch_operands"] = attrs["scalar_prefetch"]      # 1 scratch ref
  del attrs["scalar_prefetch"]
  assert dialect.entry_layout(attrs, n_refs) == KernelLayout.of(
      prefetch=0, inputs=3, outputs=1, scratch=1)


def _reference(idx, x, y):
  return x * y + x + idx[0].astype(jnp.float32)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_jvp_and_vmap_of_an_aliased_kernel_with_prefetch(backend):
  """jvp adds tangent groups (the aliased input's tangent aliased to the
  output's), vmap batches the inputs after the scalar prefetch. (Pallas
  runs the kernel, not its jvp: it has none with scalar prefetch.)"""
  idx, x, y = _operands()
  mine = lambda x, y: _prefetch_call(pltpu, idx, x, y, backend=backend)
  reference = lambda x, y: _reference(idx, x, y)
  np.testing.assert_allclose(
      mine(x, y), _prefetch_call(jpltpu, idx, x, y, interpret=True),
      rtol=1e-6)
  tx, ty = jnp.sin(x), x * 0.5
  out, tan = jax.jvp(mine, (x, y), (tx, ty))
  want, want_tan = jax.jvp(reference, (x, y), (tx, ty))
  np.testing.assert_allclose(out, want, rtol=1e-6)
  np.testing.assert_allclose(tan, want_tan, rtol=1e-6)
  xs, ys = jnp.stack([x, -x]), jnp.stack([y, y + 1])
  np.testing.assert_allclose(jax.vmap(mine)(xs, ys),
                             jax.vmap(reference)(xs, ys), rtol=1e-6)
