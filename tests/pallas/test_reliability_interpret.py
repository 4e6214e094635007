"""Cases where the host backends disagreed with each other or with Pallas:
blocks placed outside their array by static index maps, state carried
across grid steps in scratch, and masked accesses through a `pl.ds` that runs
past the array end. Each kernel is compared with a plain jax.numpy reference
and, where Pallas runs it, with jax.experimental.pallas in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl as pl
from dsl.errors import KernelError

HOST_BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")


# ------------------------------------------------- blocks outside the array

def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _copy(backend, in_map, out_map=lambda i: (i, 0), grid=(4,),
          shape=(32, 128), block=(8, 128), in_block=None):
  return pl.pallas_call(
      copy_kernel, jax.ShapeDtypeStruct(shape, jnp.float32), grid=grid,
      in_specs=[pl.BlockSpec(in_block or block, in_map)],
      out_specs=pl.BlockSpec(block, out_map), backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_element_offsets_as_block_indices_are_a_trace_time_error(backend):
  x = jnp.ones((32, 128), jnp.float32)
  call = _copy(backend, lambda i: (i * 8, 0))
  with pytest.raises(KernelError) as e:
    jax.jit(call).trace(x)
  msg = str(e.value)
  assert "in_specs[0]" in msg
  assert "grid point (1,)" in msg and "(8, 0)" in msg
  assert "index maps return block indices, not element offsets" in msg


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_negative_block_index_is_a_trace_time_error(backend):
  x = jnp.ones((32, 128), jnp.float32)
  call = _copy(backend, lambda i: (i, 0), out_map=lambda i: (i - 1, 0))
  with pytest.raises(KernelError, match=r"out_specs\[0\].*grid point \(0,\)"):
    call(x)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_partial_edge_blocks_stay_legal(backend):
  x = jnp.arange(20 * 128, dtype=jnp.float32).reshape(20, 128)
  call = _copy(backend, lambda i: (i, 0), grid=(3,), shape=(20, 128))
  np.testing.assert_array_equal(jax.jit(call)(x), x)


def test_element_dims_are_checked_against_array_and_padding():
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  ok = _copy("interpret", lambda i: (i * 8, 0),
             in_block=(pl.Element(8), 128))
  np.testing.assert_array_equal(jax.jit(ok)(x), x)
  bad = _copy("interpret", lambda i: (i * 8 + 8, 0),
              in_block=(pl.Element(8), 128))
  with pytest.raises(KernelError, match=r"grid point \(3,\).*element offset 32"):
    bad(x)
