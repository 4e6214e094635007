"""The same kernel source runs under jax.experimental.pallas (interpret mode,
the peer) and under dsl, by changing only the module it uses."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as jpl

import dsl

from jax.experimental.pallas import triton as jpl_triton
from tests.pallas.testing import assert_close, matmul_kernel_for

TRITON = {dsl: dsl.triton, jpl: jpl_triton}


def masked_kernel_for(pl, n, block):
  plt = TRITON[pl]
  def kernel(x_ref, o_ref):
    offs = pl.program_id(0) * block + jnp.arange(block)
    x = plt.load(x_ref.at[pl.ds(0, block)], mask=offs < n, other=0.0)
    plt.store(o_ref.at[pl.ds(0, block)], jnp.exp(x), mask=offs < n)
  return kernel


def loop_kernel_for(pl):
  def kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[pl.ds(i * 4, 4)]
    o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[0] // 4, body,
                                   jnp.zeros((4,), jnp.float32))
  return kernel


def run(pl, name):
  interp = {"interpret": True}
  if name == "matmul":
    x = jax.random.normal(jax.random.key(0), (32, 48))
    y = jax.random.normal(jax.random.key(1), (48, 16))
    return pl.pallas_call(
        matmul_kernel_for(pl), jax.ShapeDtypeStruct((32, 16), jnp.float32),
        grid=(2, 1, 3),
        in_specs=[pl.BlockSpec((16, 16), lambda i, j, k: (i, k)),
                  pl.BlockSpec((16, 16), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((16, 16), lambda i, j, k: (i, j)), **interp)(x, y)
  if name == "masked":
    n, block = 50, 16
    x = jnp.linspace(-1, 1, n)
    return pl.pallas_call(
        masked_kernel_for(pl, n, block), jax.ShapeDtypeStruct((n,), jnp.float32),
        grid=(pl.cdiv(n, block),),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)), **interp)(x)
  if name == "loop":
    x = jnp.arange(32.)
    return pl.pallas_call(loop_kernel_for(pl),
                          jax.ShapeDtypeStruct((4,), jnp.float32), **interp)(x)
  raise ValueError(name)


@pytest.mark.parametrize("name", ["matmul", "masked", "loop"])
def test_same_source_same_result(name):
  ours = run(dsl, name)
  peer = run(jpl, name)
  assert_close(ours, peer)
