"""docs/architecture.md, "How to add a backend", followed: a tiny backend
built from the registry's record and the rule-table contract alone (no
dsl internals, no other backend's code) runs kernels through pallas_call.

"numpy_host" runs the kernel jaxpr in NumPy in a host callback, one grid
point after another, with a rule table of a dozen primitives. It is
compared with jax.numpy, with backend="interpret" and with Pallas's
interpret mode; a primitive outside its table is a clear error at lowering
time naming the kernel, the primitive and the user's line."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from dsl.core.jax_internals import (mlir, state_indexing as indexing,
                                    state_primitives as state_prims)
from jax.experimental import pallas as jpl

import dsl as pl
from dsl.core import backends, host_failures
from dsl.core.errors import BackendError, source_info_frame
from dsl.core.jaxpr_walk import LoweringHost, RuleTable, walk_jaxpr
from tests.pallas.testing import PALLAS, assert_close, run_on

NAME = "numpy_host"

# ------------------------------------------------------- the rule table

TABLE = RuleTable("the numpy_host backend")

for _prim, _fn in ((lax.add_p, np.add), (lax.sub_p, np.subtract),
                   (lax.mul_p, np.multiply), (lax.max_p, np.maximum),
                   (lax.neg_p, np.negative)):
  TABLE.register(_prim)(lambda ctx, *xs, _fn=_fn, **_: _fn(*xs))


@TABLE.register(lax.reduce_sum_p)
def _reduce_sum(ctx, x, *, axes, **_):
  return np.sum(x, axis=tuple(axes), dtype=x.dtype)


@TABLE.register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *, shape, broadcast_dimensions, **_):
  expanded = np.expand_dims(np.asarray(x), tuple(
      d for d in range(len(shape)) if d not in broadcast_dimensions))
  return np.broadcast_to(expanded, shape)


@TABLE.register(lax.convert_element_type_p)
def _convert(ctx, x, *, new_dtype, **_):
  return np.asarray(x).astype(new_dtype)


def _np_index(transforms):
  """A numpy index from a ref's indexers (static slices and indices)."""
  if not transforms:                      # the whole ref: x_ref[...]
    return ...
  (indexer,) = transforms
  assert isinstance(indexer, indexing.NDIndexer), indexer
  return tuple(
      slice(int(i.start), int(i.start) + int(i.size) * int(i.stride),
            int(i.stride)) if isinstance(i, indexing.Slice) else int(i)
      for i in indexer.indices)


@TABLE.register(state_prims.get_p)
def _get(ctx, ref, *flat_idx, tree):
  return np.array(ref[_np_index(jax.tree.unflatten(tree, flat_idx))])


@TABLE.register(state_prims.swap_p)
def _swap(ctx, ref, value, *flat_idx, tree):
  where = _np_index(jax.tree.unflatten(tree, flat_idx))
  old = np.array(ref[where])
  ref[where] = value
  return old


# ------------------------------------------------------- the host and launch

class NumpyHost(LoweringHost):
  """Runs a kernel jaxpr on NumPy values; refs are NumPy arrays."""
  rules = TABLE

  def __init__(self, spec):
    self.spec = spec

  def literal(self, atom):
    return np.asarray(atom.val, atom.aval.dtype)

  def constvar(self, var, value):
    return np.asarray(value)

  def rule_context(self, eqn, used, position):
    return self

  def error(self, message, eqn=None):
    where = source_info_frame(eqn.source_info) if eqn is not None else None
    return BackendError(self.spec.name, message, where or self.spec.where)


def _block(bm, indices):
  """The numpy index of the block at `indices` (its index map's results)."""
  offsets = bm.element_offsets(indices)
  return tuple(slice(int(o), int(o) + s)
               for o, s in zip(offsets, bm.block_sizes))


def _run(spec, *operands):
  """Every grid point in order; output blocks are written back after each."""
  gm = spec.grid_mapping
  host = NumpyHost(spec)
  ins = [np.asarray(x) for x in operands]
  outs = [np.zeros(a.shape, a.dtype) for a in gm.out_avals]
  maps = [(bm, gm.block_indices(bm)) for bm in gm.in_mappings]
  out_maps = [(bm, gm.block_indices(bm)) for bm in gm.out_mappings]
  for point in np.ndindex(*gm.grid):
    in_blocks = [x[_block(bm, idx[point])].reshape(bm.kernel_shape)
                 for x, (bm, idx) in zip(ins, maps)]
    out_blocks = [o[_block(bm, idx[point])].reshape(bm.kernel_shape).copy()
                  for o, (bm, idx) in zip(outs, out_maps)]
    ids = [np.int32(i) for i in point]
    walk_jaxpr(host, spec.jaxpr.jaxpr, spec.jaxpr.consts,
               [*ids, *in_blocks, *out_blocks])
    for o, (bm, idx), b in zip(outs, out_maps, out_blocks):
      o[_block(bm, idx[point])] = b.reshape(bm.block_sizes)
  return outs


def numpy_host_lowering(ctx, *args, spec):
  """pallas_call's lowering rule for backend "numpy_host"."""
  gm = spec.grid_mapping
  host = NumpyHost(spec)
  for eqn in spec.jaxpr.jaxpr.eqns:     # unsupported: an error now, not later
    if eqn.primitive not in TABLE:
      raise host.unsupported(eqn)
  if gm.num_scalar_prefetch or gm.scratch_avals or any(
      gm.block_indices(bm) is None for bm in gm.in_mappings + gm.out_mappings):
    raise host.error("numpy_host runs kernels without scalar prefetch, "
                     "scratch or data-dependent blocks")
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.out_avals]
  axis_context = ctx.module_context.axis_context

  def call(*xs):
    outs, failed = host_failures.call_host(
        lambda *arrays: _run(spec, *arrays), shapes, *xs, kernel=spec.name)
    host_failures.raise_parked(axis_context, failed)
    return outs
  return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


@contextlib.contextmanager
def numpy_host_backend():
  """Registers the backend for the test's duration: its record, then its
  lowering and rule table, as a backend package's __init__ does."""
  backends.register(backends.Backend(
      NAME, package=None, platforms=("cpu", "cuda", "rocm", "tpu"),
      on_host=True, code="numpy", values_in_memory=None))
  backends.register_backend(NAME, numpy_host_lowering, rules=TABLE)
  try:
    yield
  finally:
    del backends.REGISTRY[NAME]


@pytest.fixture
def numpy_host():
  with numpy_host_backend():
    yield NAME


# ------------------------------------------------------- the tests

def _row_kernel(api):
  """A kernel written with `api` (dsl or Pallas)."""
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    row = jnp.sum(x, axis=1, keepdims=True)
    o_ref[...] = (jnp.maximum(x * 2 - row, -x)
                  + api.program_id(0).astype(x.dtype))
  return kernel


def _row_specs(block_rows, cols):
  def specs(api):
    spec = api.BlockSpec((block_rows, cols), lambda i: (i, 0))
    return dict(in_specs=[spec], out_specs=spec)
  return specs


def _row_reference(x, block_rows):
  ids = (jnp.arange(x.shape[0]) // block_rows).astype(x.dtype)[:, None]
  row = jnp.sum(x, axis=1, keepdims=True)
  return jnp.maximum(x * 2 - row, -x) + ids


@pytest.mark.parametrize("shape,block_rows,dtype", [
    ((16, 128), 8, jnp.float32),
    ((24, 32), 8, jnp.int32),
    ((6, 256), 2, jnp.float32),
])
def test_extra_backend_runs_kernels_like_the_others(numpy_host, shape,
                                                    block_rows, dtype):
  x = (jnp.arange(np.prod(shape)).reshape(shape) % 13 - 6).astype(dtype)
  out = jax.ShapeDtypeStruct(shape, dtype)
  kw = dict(grid=(shape[0] // block_rows,),
            specs=_row_specs(block_rows, shape[1]))
  want = _row_reference(x, block_rows)
  got = run_on(numpy_host, _row_kernel(pl), out, x, **kw)
  assert_close(got, want, dtype)
  for peer, api in (("interpret", pl), (PALLAS, jpl)):
    assert_close(got, run_on(peer, _row_kernel(api), out, x, **kw), dtype)


def test_extra_backend_is_listed_and_resolved(numpy_host):
  assert backends.resolve(numpy_host) == NAME
  assert backends.runs_on_host(numpy_host)
  assert backends.rule_table(numpy_host) is TABLE
  assert NAME not in pl.BACKENDS          # the built-in list is unchanged


def test_extra_backend_names_an_unsupported_primitive(numpy_host):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])      # exp is not in its table
  x = jnp.ones((8, 128), jnp.float32)
  call = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        backend=numpy_host)
  with pytest.raises(BackendError) as info:
    jax.jit(call)(x)
  text = str(info.value)
  assert "'exp' is not supported by the numpy_host backend" in text
  assert "kernel" in text and "test_extra_backend.py:" in text


def test_extra_backend_is_gone_after_its_test():
  assert NAME not in backends.REGISTRY
  with pytest.raises(BackendError, match="unknown backend 'numpy_host'"):
    pl.pallas_call(lambda o_ref: None, jax.ShapeDtypeStruct((8,), jnp.float32),
                   backend=NAME)()
