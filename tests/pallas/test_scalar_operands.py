"""Python scalars and numpy scalars as pallas_call operands, as Pallas takes
them: a Python scalar is a weakly typed 0-d array of JAX's default dtype
(its value in the kernel follows JAX's promotion), a numpy scalar an array
of its own dtype; under jit, vmap (`in_axes=None`) and grad, on every CPU
backend that runs 0-d blocks, against jnp and Pallas in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpl_tpu

import dsl
from dsl import tpu as dtpu
from tests.pallas.testing import assert_close

# Mosaic keeps scalars in SMEM (see test_scalar_in_smem_on_mosaic).
BACKENDS = ("interpret", "triton_interpret")


def add_kernel(x_ref, s_ref, o_ref):
  o_ref[...] = x_ref[...] + s_ref[...]


def add(pl, x, s, **kw):
  return pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        **kw)(x, s)


SCALARS = [1, -2.5, True, np.float32(2.0), np.int32(3), np.int64(4),
           np.bool_(False)]


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8,
                                   jnp.int32])
def test_scalar_operand_has_pallas_dtype(backend, dtype):
  x = jnp.arange(-4, 4).astype(dtype)
  for s in SCALARS:
    want_err = None
    try:
      want = jax.block_until_ready(add(jpl, x, s, interpret=True))
    except ValueError as e:          # a store of a wider dtype
      want_err = e
    if want_err is not None:
      with pytest.raises(dsl.KernelError, match="cast it first"):
        add(dsl, x, s, backend=backend)
      continue
    got = add(dsl, x, s, backend=backend)
    assert got.dtype == want.dtype, (s, got.dtype, want.dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(x + s, np.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_python_scalar_stays_weak_in_the_kernel():
  seen = []

  def kernel(s_ref, o_ref):
    v = s_ref[...]
    seen.append(jax.typeof(v).weak_type)
    o_ref[...] = jnp.full(o_ref.shape, v, o_ref.dtype)
  for s, weak in ((7, True), (np.int32(7), False)):
    out = dsl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int8))(s)
    np.testing.assert_array_equal(out, np.full(4, 7, np.int8))
    assert seen[-1] is weak


def copyitem_kernel(x_ref, in_idx_ref, out_idx_ref, o_ref):
  o_ref[...] = x_ref[...]
  o_ref[out_idx_ref[...]] = x_ref[in_idx_ref[...]]


def copyitem(pl, x, in_idx, out_idx, **kw):
  return pl.pallas_call(copyitem_kernel,
                        jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)(
                            x, in_idx, out_idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_indices_under_jit_and_vmap(backend):
  x = jnp.arange(8, dtype=jnp.float32)
  want = x.at[1].set(x[3])
  got = jax.jit(lambda x: copyitem(dsl, x, 3, 1, backend=backend))(x)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, copyitem(jpl, x, 3, 1, interpret=True))
  xs = jnp.stack([x, -x])
  f = lambda x, i, o: copyitem(dsl, x, i, o, backend=backend)
  got = jax.vmap(f, in_axes=(0, None, None))(xs, 3, 1)
  np.testing.assert_array_equal(got, xs.at[:, 1].set(xs[:, 3]))
  got = jax.vmap(lambda x: add(dsl, x, 1, backend=backend))(xs)
  np.testing.assert_array_equal(got, xs + 1)
  got = jax.vmap(lambda x, s: add(dsl, x, s, backend=backend),
                 in_axes=(0, None))(xs, 2.5)
  np.testing.assert_array_equal(got, xs + 2.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_a_scalar_operand(backend):
  x = jnp.linspace(-1, 1, 8, dtype=jnp.float32)

  def loss(x, s):
    return jnp.sum(add(dsl, x * x, s, backend=backend) ** 2)
  want = jax.grad(lambda x, s: jnp.sum((x * x + s) ** 2), argnums=(0, 1))
  got = jax.grad(loss, argnums=(0, 1))(x, 0.5)
  assert_close(got[0], want(x, 0.5)[0])
  assert_close(got[1], want(x, 0.5)[1])
  got = jax.jit(jax.grad(lambda x: loss(x, 1.5)))(x)
  assert_close(got, want(x, 1.5)[0])


def test_scalar_in_smem_on_mosaic():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  f = dsl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[None, dsl.BlockSpec(memory_space=dtpu.SMEM)],
      backend="mosaic_interpret")
  np.testing.assert_array_equal(jax.jit(lambda x: f(x, 2.0))(x), x + 2.0)
  with pytest.raises(dsl.KernelError, match="SMEM"):
    dsl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                    backend="mosaic_interpret")(x, 2.0)


def test_a_non_array_operand_is_a_clear_error():
  x = jnp.ones((8,), jnp.float32)
  with pytest.raises(dsl.KernelTypeError, match="argument 1: expected an "
                     "array"):
    add(dsl, x, "one")


def _gather_rows_kernel(rows_ref, unused_ref, x_ref, o_ref):
  del rows_ref, unused_ref
  o_ref[...] = x_ref[...] * 2


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_none_scalar_prefetch_operand_reaches_the_index_map(backend):
  """A scalar-prefetch operand that is None (splash attention passes its
  mask data so) is an argument of the index maps, None, as in Pallas."""
  x = jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(32, 128)
  rows = jnp.array([3, 0, 2, 1], jnp.int32)

  def index_map(i, rows_ref, unused_ref):
    assert unused_ref is None
    return rows_ref[i], 0

  def run(pl, tpu, **kw):
    return pl.pallas_call(
        _gather_rows_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(4,),
            in_specs=[pl.BlockSpec((8, 128), index_map)],
            out_specs=pl.BlockSpec((8, 128), lambda i, r, u: (i, 0))),
        **kw)(rows, None, x)

  got = run(dsl, dtpu, backend=backend)
  want = jnp.concatenate([x[8 * r:8 * r + 8] for r in [3, 0, 2, 1]]) * 2
  assert_close(got, want)
  with jpl_tpu.force_tpu_interpret_mode():
    assert_close(got, run(jpl, jpl_tpu))
