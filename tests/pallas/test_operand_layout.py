"""The two operand layouts every rule decodes through dsl's core: a ref
primitive's operands (`dsl.core.operand_layout.ref_operands`) and the
kernel's operands by role (`GridMapping.split`, `KernelArgs`)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt
from dsl.core import ref_ops
from dsl.core.inspection import traced_kernels
from dsl.core.jax_internals import state_primitives
from dsl.core.operand_layout import (eqn_ref_operands, flat_ref_operands,
                                     ref_operands)


def _every_access(x_ref, o_ref, s_ref):
  lanes = jax.lax.broadcasted_iota(jnp.int32, (8,), 0)
  o_ref[...] = jnp.zeros((16,), jnp.float32)
  s_ref[...] = x_ref[pl.ds(0, 8)]                          # get, swap
  s_ref[pl.ds(0, 8)] += 1.0                                # addupdate
  v = plt.load(x_ref.at[pl.ds(8, 8)], mask=lanes < 5, other=-1.0)
  o_ref[pl.ds(0, 8)] = v + s_ref[...]
  plt.store(o_ref.at[pl.ds(8, 8)], v * 2, mask=lanes % 2 == 0)
  plt.atomic_add(o_ref, pl.ds(0, 8), jnp.ones((8,), jnp.float32),
                 mask=lanes < 3)
  plt.atomic_cas(o_ref.at[15], jnp.float32(0), jnp.float32(7))


def _call(x, backend=None):
  return pl.pallas_call(
      _every_access, jax.ShapeDtypeStruct((16,), jnp.float32),
      scratch_shapes=[pltpu.VMEM((8,), jnp.float32)], backend=backend)(x)


def _kernel_eqns():
  x = jax.ShapeDtypeStruct((16,), jnp.float32)
  (spec, _), = traced_kernels(_call, x)
  return spec, spec.jaxpr.jaxpr.eqns


def _want(x):
  x = np.asarray(x)
  lanes = np.arange(8)
  v = np.where(lanes < 5, x[8:], -1.0)
  o = np.zeros(16, np.float32)
  o[:8] = v + x[:8] + 1
  o[8:] = np.where(lanes % 2 == 0, v * 2, 0)
  o[:3] += 1
  o[15] = 7.0          # it held 0
  return o


def test_ref_operands_name_every_part_of_each_access():
  spec, eqns = _kernel_eqns()
  _, _, (x_ref,), (o_ref,), (s_ref,), _ = spec.grid_mapping.split(
      spec.jaxpr.jaxpr.invars)
  seen = {}
  for eqn in eqns:
    if eqn.primitive.name not in ("get", "swap", "addupdate", "masked_load",
                                  "masked_store", "atomic_rmw", "atomic_cas"):
      continue
    ops = eqn_ref_operands(eqn)
    seen.setdefault(eqn.primitive, ops)
    assert ops.ref in (x_ref, o_ref, s_ref)
    assert list(eqn.invars[ops.first_leaf:ops.first_leaf + len(ops.leaves)]) \
        == list(ops.leaves)
    # The decoded parts, put back, are the equation's operands and params.
    flat, layout = flat_ref_operands(eqn.primitive, ops)
    assert flat == list(eqn.invars)
    assert all(eqn.params[k] == v for k, v in layout.items())
  load, store = seen[ref_ops.masked_load_p], seen[ref_ops.masked_store_p]
  assert load.ref is x_ref and load.mask.aval.dtype == jnp.bool_
  assert load.other.aval.shape == (8,) and load.value is None
  assert store.ref is o_ref and store.value.aval.shape == (8,)
  assert store.mask.aval.dtype == jnp.bool_ and store.other is None
  rmw = seen[ref_ops.atomic_rmw_p]
  assert rmw.mask is not None and rmw.value.aval.shape == (8,)
  cas = seen[ref_ops.atomic_cas_p]
  assert cas.cmp.aval.shape == () and cas.value.aval.shape == ()
  assert cas.mask is None
  swap = seen[state_primitives.swap_p]
  assert swap.first_leaf == 2 and swap.value.aval.shape == (16,)
  assert seen[state_primitives.get_p].value is None
  (indexer,) = seen[state_primitives.get_p].transforms
  assert indexer.shape == (16,)


def test_ref_operands_decode_rule_arguments_like_invars():
  _, eqns = _kernel_eqns()
  eqn = next(e for e in eqns if e.primitive is ref_ops.masked_store_p)
  args = [f"operand{k}" for k in range(len(eqn.invars))]
  ops = ref_operands(eqn.primitive, args, eqn.params)
  by_var = eqn_ref_operands(eqn)
  for field in dataclasses.fields(ops):
    mine, theirs = getattr(ops, field.name), getattr(by_var, field.name)
    if field.name in ("tree", "first_leaf"):
      assert mine == theirs
    elif field.name == "leaves":
      assert mine == tuple(args[ops.first_leaf:ops.first_leaf + len(mine)])
    else:
      assert (mine is None) == (theirs is None)
      if mine is not None:
        assert mine == args[list(eqn.invars).index(theirs)]


def test_ref_operands_refuse_leaves_that_do_not_fit_the_tree():
  _, eqns = _kernel_eqns()
  eqn = next(e for e in eqns if e.primitive is state_primitives.get_p)
  ops = eqn_ref_operands(eqn)
  with pytest.raises(ValueError, match="cannot read the ref indexers"):
    ops.transforms_of(ops.leaves + ("one too many",))


# The TPU has no atomics: mosaic_interpret refuses this kernel.
@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_every_access_runs_on_the_backends_with_atomics(backend):
  x = jnp.arange(16, dtype=jnp.float32) + 1
  np.testing.assert_allclose(_call(x, backend), _want(x))


def test_kernel_args_split_the_jaxpr_invars_and_the_operands():
  spec, _ = _kernel_eqns()
  gm = spec.grid_mapping
  invars = spec.jaxpr.jaxpr.invars
  args = gm.split(invars)
  assert (len(args.ids), len(args.prefetch), len(args.inputs),
          len(args.outputs), len(args.scratch)) == (0, 0, 1, 1, 1)
  assert gm.split(range(gm.num_refs)) == ((), (), (0,), (1,), (2,), ())
  assert gm.split_operands(["x"]).inputs == ("x",)
  with pytest.raises(ValueError, match="operands"):
    gm.split(range(gm.num_refs + 1))
