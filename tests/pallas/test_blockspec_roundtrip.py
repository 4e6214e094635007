"""A derived kernel keeps every option of its operands' BlockSpecs.

vmap, jvp, grad and sharding build new kernels from a kernel's
BlockMappings (`BlockMapping.to_spec`); every field a user can set on a
BlockSpec (block shape with squeezed and Element dims, index map, memory
space, pipeline mode, the user's line) must come through. Then
`pipeline_mode=pl.Buffered(n)` per backend: the Mosaic GPU ring depth,
refused on Triton as in Pallas.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.blockspec import Buffered, Element, squeezed
from dsl.core.inspection import traced_kernels
from dsl.transforms import partitioning
from tests.pallas import testing
from tests.pallas.mosaic_gpu_testing import (BF, _deep_kernel, deep_ring,
                                             gpu_module)

ROWS, COLS = 16, 256
MEMORY = (None, pltpu.VMEM, pltpu.SMEM)


def _call(x_spec, backend="interpret"):
  """y = 2 * x + 1 over an 2 x 2 grid, with x blocked by `x_spec`."""
  def kernel(x_ref, o_ref):
    v = x_ref[...]
    o_ref[...] = jnp.broadcast_to(2.0 * v + 1.0, o_ref.shape)[:o_ref.shape[0]]
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32), grid=(2, 2),
      in_specs=[x_spec],
      out_specs=pl.BlockSpec((ROWS // 2, COLS // 2), lambda i, j: (i, j)),
      backend=backend)


def _x_spec(kind, memory, mode):
  shape = {"blocked": (ROWS // 2, COLS // 2),
           "element": (Element(ROWS // 2), COLS // 2)}[kind]
  index_map = {"blocked": lambda i, j: (i, j),
               "element": lambda i, j: (i * (ROWS // 2), j)}[kind]
  return pl.BlockSpec(shape, index_map, memory_space=memory,
                      pipeline_mode=mode)


def _derived(fn, *args):
  """Every kernel fn's trace holds (vmap, jvp, grad derive their own)."""
  return [spec for spec, _ in traced_kernels(fn, *args)]


def _x_mappings(specs):
  """The block mapping of x in each kernel: every derived kernel takes x
  (or its batch) first."""
  return [spec.grid_mapping.in_mappings[0] for spec in specs]


TRANSFORMS = {
    "vmap": lambda f: (jax.vmap(f), (3, ROWS, COLS)),
    "jvp": lambda f: (lambda x: jax.jvp(f, (x,), (x,)), (ROWS, COLS)),
    "grad": lambda f: (jax.grad(lambda x: f(x).sum()), (ROWS, COLS)),
}


@given(kind=st.sampled_from(["blocked", "element"]),
       memory=st.sampled_from(MEMORY),
       mode=st.sampled_from([None, Buffered(1), Buffered(2), Buffered(3)]),
       transform=st.sampled_from(sorted(TRANSFORMS)))
@testing.hypothesis_settings(12)
def test_derived_kernels_keep_every_blockspec_field(kind, memory, mode,
                                                     transform):
  spec = _x_spec(kind, memory, mode)
  fn, shape = TRANSFORMS[transform](_call(spec))
  x = jnp.zeros(shape, jnp.float32)
  mappings = _x_mappings(_derived(fn, x))
  assert mappings, "no derived kernel reads x"
  for bm in mappings:
    assert bm.pipeline_mode == mode
    assert bm.memory_space == memory
    assert bm.where == spec.where
    assert bm.block_shape[-2:] == tuple(
        squeezed if d is None else d for d in spec.block_shape)


def test_to_spec_gives_the_mapping_back():
  spec = _x_spec("element", pltpu.VMEM, Buffered(3))
  (kernel,) = _derived(_call(spec), jnp.zeros((ROWS, COLS)))
  bm = kernel.grid_mapping.in_mappings[0]
  again = bm.to_spec()
  assert (again.memory_space, again.pipeline_mode, again.where) == (
      spec.memory_space, spec.pipeline_mode, spec.where)
  assert again.block_shape == spec.block_shape
  assert again.index_map(1, 0) == (ROWS // 2, 0)
  batched = bm.to_spec(lambda b, i, j: (b, i * 8, j), lead=1)
  assert batched.block_shape == (None, *spec.block_shape)


def test_vmapped_kernel_with_buffered_operands_agrees():
  spec = _x_spec("blocked", None, Buffered(1))
  x = testing.array(0, (3, ROWS, COLS), jnp.float32)
  got = jax.jit(jax.vmap(_call(spec)))(x)
  np.testing.assert_allclose(got, 2 * x + 1)


def test_triton_refuses_pipeline_mode_naming_the_operand():
  spec = _x_spec("blocked", None, Buffered(2))   # BUFFERED-LINE
  x = jnp.zeros((ROWS, COLS), jnp.float32)
  with pytest.raises(pl.BackendError) as e:
    jax.jit(_call(spec, backend="triton_interpret"))(x)
  msg = str(e.value)
  assert "in_specs[0]" in msg and "pipeline_mode" in msg
  assert "num_stages" in msg
  assert "test_blockspec_roundtrip.py" in msg


def _buffered_ring(n, **params):
  """deep_ring's kernel with its input BlockSpec Buffered(n)."""
  def f(x):
    return pl.pallas_call(
        _deep_kernel, jax.ShapeDtypeStruct((128, 128), jnp.float32),
        grid=(2, 8),
        in_specs=[pl.BlockSpec((64, 128), lambda i, j: (i, j),
                               pipeline_mode=pl.Buffered(n))],
        out_specs=pl.BlockSpec((64, 128), lambda i, j: (i, 0)),
        compiler_params=pl.mosaic_gpu.CompilerParams(**params),
        backend="mosaic_gpu")(x)
  return f, BF(128, 128 * 8)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_buffered_sets_the_mosaic_gpu_ring_depth(n):
  f, x = _buffered_ring(n)
  assert gpu_module(f, x).plan.schedule.depth == n
  default, x = deep_ring(64, 128, 8)
  assert gpu_module(default, x).plan.schedule.depth == 4


def test_buffered_and_pipeline_depth_must_agree_on_mosaic_gpu():
  f, x = _buffered_ring(3, pipeline_depth=2)
  with pytest.raises(pl.BackendError, match="disagree"):
    gpu_module(f, x)
  f, x = _buffered_ring(2, pipeline_depth=2)
  assert gpu_module(f, x).plan.schedule.depth == 2


def test_a_shard_keeps_every_blockspec_field():
  """The kernel each device runs under sharded jit (its grid split, and
  the program-id offsets added as an operand) keeps x's BlockSpec."""
  def kernel(x_ref, o_ref):      # reads the program id: offsets are added
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)
  spec = _x_spec("blocked", pltpu.VMEM, Buffered(3))
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32), grid=(2, 2),
      in_specs=[spec],
      out_specs=pl.BlockSpec((ROWS // 2, COLS // 2), lambda i, j: (i, j)))
  (kernel_spec,) = _derived(call, jnp.zeros((ROWS, COLS)))
  local = partitioning.local_spec(kernel_spec, ((0, 2),))
  assert local.grid_mapping.grid == (1, 2)
  assert local.grid_mapping.num_scalar_prefetch == 1     # the offsets
  (bm,) = local.grid_mapping.in_mappings
  assert (bm.pipeline_mode, bm.memory_space, bm.where) == (
      spec.pipeline_mode, spec.memory_space, spec.where)
