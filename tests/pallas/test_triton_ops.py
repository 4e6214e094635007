"""Operations inside kernels under backend="triton_interpret", each against
a jnp reference: elementwise math, casts, reductions, shapes, dots, control
flow, refs and atomics, on several shapes (powers of two and not) and dtypes."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax import lax

import dsl as pl
from dsl import triton as plt
from dsl import tpu as pltpu
import lowering_triton
from lowering_triton.compile import compile_kernel
from tests.pallas.testing import (TRITON_ARCHS, array, assert_close, call,
                                  default_backend, hypothesis_settings,
                                  test_cases)

# Triton's interpreter is slow: few examples, small shapes.
SETTINGS = hypothesis_settings(8)


def _whole(fn, x, out_dtype=None, out_shape=None):
  """Runs `o = fn(x)` as a one-block kernel."""
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...]).astype(o_ref.dtype)
  want = fn(x)
  shape = jax.ShapeDtypeStruct(out_shape or want.shape, out_dtype or want.dtype)
  return call(kernel, shape, x), want


# ------------------------------------------------------------------ elementwise

# Compositions of primitives (each primitive alone, on every dtype and
# backend: test_op_table.py), at shapes that leave padded lanes.
UNARY = {
    "exp_of_log": lambda x: jnp.exp(jnp.log(jnp.abs(x) + 0.5)),
    "recip_pow": lambda x: (jnp.abs(x) + 1) ** -2,
    "gelu": jax.nn.gelu, "silu": jax.nn.silu, "relu": jax.nn.relu,
    "softplus": jax.nn.softplus, "isfinite": lambda x: jnp.isfinite(1.0 / x),
    "tanh_of_sin": lambda x: jnp.tanh(jnp.sin(x) * 3),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("shape", [(8,), (5, 12)])
def test_unary_math(name, shape):
  x = array(hash(name) % 1000, shape, jnp.float32) * 2
  got, want = _whole(UNARY[name], x)
  assert_close(got, want, tol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_math_is_computed_in_float32(dtype):
  x = array(1, (4, 16), dtype)
  fn = lambda x: jnp.exp(x) * x - jnp.tanh(x) / (1 + x * x)
  got, want = _whole(fn, x)
  assert got.dtype == dtype
  assert_close(got, want, dtype)


INT_BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
    "div": lax.div, "rem": lax.rem, "floordiv": jnp.floor_divide,
    "mod": jnp.mod, "max": jnp.maximum, "min": jnp.minimum,
    "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor,
    "shl": lambda a, b: a << (b & 7), "shr": lambda a, b: a >> (b & 7),
    "shr_logical": lambda a, b: lax.shift_right_logical(a, b & 7),
}


@pytest.mark.parametrize("name", sorted(INT_BINARY))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint32])
def test_integer_binary(name, dtype):
  lo = 0 if dtype == jnp.uint32 else -40
  a = array(3, (16,), dtype, lo, 40)
  b = array(4, (16,), dtype, 1, 9)
  fn = INT_BINARY[name]

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = fn(a_ref[...], b_ref[...]).astype(o_ref.dtype)
  want = fn(a, b)
  got = call(kernel, jax.ShapeDtypeStruct(want.shape, want.dtype), a, b)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_comparisons_where_select_clamp(dtype):
  a, b = array(5, (6, 10), dtype), array(6, (6, 10), dtype)

  def fn(a, b):
    pick = jnp.where(a > b, a, b) + jnp.where(a <= b, a, 0).astype(a.dtype)
    eq = (a == b) | (a != b) & (a >= b)
    out = jnp.where(eq, pick, -pick)
    return lax.clamp(jnp.asarray(-3, a.dtype), out, jnp.asarray(3, a.dtype))

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = fn(a_ref[...], b_ref[...])
  got = call(kernel, jax.ShapeDtypeStruct(a.shape, dtype), a, b)
  assert_close(got, fn(a, b), dtype)


def test_logical_ops_on_bools():
  a = array(7, (16,), jnp.int32)

  def kernel(a_ref, o_ref):
    x = a_ref[...]
    p, q = x > 0, x % 3 == 0
    o_ref[...] = ((p & ~q) | (p ^ q)).astype(jnp.int32)
  got = call(kernel, jax.ShapeDtypeStruct(a.shape, jnp.int32), a)
  p, q = a > 0, a % 3 == 0
  np.testing.assert_array_equal(got, ((p & ~q) | (p ^ q)).astype(jnp.int32))


CASTS = [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
         (jnp.float32, jnp.float16), (jnp.float16, jnp.float32),
         (jnp.float32, jnp.int32), (jnp.int32, jnp.float32),
         (jnp.int32, jnp.int8), (jnp.int8, jnp.int32), (jnp.float32, jnp.bool_),
         (jnp.bool_, jnp.float32), (jnp.int32, jnp.bool_),
         (jnp.uint8, jnp.float32), (jnp.float32, jnp.uint8),
         (jnp.float32, jnp.float8_e4m3fn), (jnp.float8_e5m2, jnp.float32)]


@pytest.mark.parametrize("src,dst", CASTS)
def test_casts(src, dst):
  if src == jnp.float8_e5m2:
    x = array(8, (4, 8), jnp.float32).astype(src)
  elif src == jnp.uint8:
    x = array(8, (4, 8), src, 0, 255)
  elif dst == jnp.uint8:
    x = jnp.abs(array(8, (4, 8), src)) * 10
  else:
    x = array(8, (4, 8), src) * (3 if dst == jnp.int32 else 1)
  got, want = _whole(lambda v: v.astype(dst), x)
  assert got.dtype == jnp.dtype(dst)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))


def test_bitcast():
  x = array(9, (8,), jnp.float32)
  got, want = _whole(lambda v: lax.bitcast_convert_type(v, jnp.int32), x)
  np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ reductions

REDUCTIONS = {
    "sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod,
    "argmax": lambda x, axis: jnp.argmax(x, axis).astype(jnp.int32),
    "argmin": lambda x, axis: jnp.argmin(x, axis).astype(jnp.int32),
    "mean": jnp.mean, "logsumexp": jax.nn.logsumexp,
    "cumsum": lambda x, axis: jnp.cumsum(x, axis),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("shape,axis", [((16,), 0), ((6, 10), 1), ((6, 10), 0),
                                        ((3, 5, 8), 1)])
def test_reductions_mask_padded_lanes(name, shape, axis):
  x = array(10, shape, jnp.float32)
  if name == "prod":
    x = 1 + 0.1 * x
  if name == "max":           # all negative: padding must not win with 0
    x = -jnp.abs(x) - 1
  fn = functools.partial(REDUCTIONS[name], axis=axis)
  got, want = _whole(fn, x)
  assert_close(got, want, tol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.int32, jnp.bool_])
def test_reductions_of_narrow_dtypes(dtype):
  x = array(11, (5, 12), dtype, -3, 4)

  def kernel(x_ref, s_ref, m_ref, a_ref):
    v = x_ref[...]
    if dtype == jnp.bool_:
      s_ref[...] = jnp.any(v, axis=1).astype(jnp.float32)
      m_ref[...] = jnp.all(v, axis=1).astype(jnp.float32)
    else:
      s_ref[...] = jnp.sum(v, axis=1).astype(jnp.float32)
      m_ref[...] = jnp.max(v, axis=1).astype(jnp.float32)
    a_ref[...] = jnp.argmax(v, axis=1).astype(jnp.int32)
  shapes = (jax.ShapeDtypeStruct((5,), jnp.float32),) * 2 + (
      jax.ShapeDtypeStruct((5,), jnp.int32),)
  s, m, a = call(kernel, shapes, x)
  if dtype == jnp.bool_:
    ws, wm = jnp.any(x, 1), jnp.all(x, 1)
  else:
    ws, wm = jnp.sum(x, 1), jnp.max(x, 1)
  assert_close(s, ws.astype(jnp.float32), dtype)
  assert_close(m, wm.astype(jnp.float32), dtype)
  np.testing.assert_array_equal(a, jnp.argmax(x, 1))


# ------------------------------------------------------------------ shapes

SHAPE_OPS = {
    "transpose": (lambda x: x.T, (6, 10)),
    "reshape_pow2": (lambda x: x.reshape(4, 32), (8, 16)),
    "reshape_rows": (lambda x: x.reshape(12, 8), (3, 32)),
    "reshape_general": (lambda x: x.reshape(5, 6), (3, 10)),
    "flatten_general": (lambda x: x.reshape(-1), (3, 5)),
    "expand_squeeze": (lambda x: x[:, None, :].sum(1), (3, 5)),
    "broadcast": (lambda x: jnp.broadcast_to(x[:, :1], (6, 10)) + x[:1], (6, 10)),
    "iota": (lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 0)
             + 2 * lax.broadcasted_iota(jnp.float32, x.shape, 1), (6, 10)),
    "slice": (lambda x: x[1:5, 2:9:3], (6, 10)),
    "rev": (lambda x: x[::-1, ::-1], (6, 10)),
    "concatenate": (lambda x: jnp.concatenate([x, 2 * x[:, :3]], axis=1),
                    (6, 10)),
    "pad": (lambda x: jnp.pad(x, ((1, 2), (0, 3)), constant_values=7.0),
            (6, 10)),
    "split": (lambda x: jnp.split(x, [3], axis=1)[1], (6, 10)),
    "stack": (lambda x: jnp.stack([x, -x], axis=0), (3, 5)),
    "dynamic_slice": (lambda x: lax.dynamic_slice(
        x, (jnp.argmax(x[:, 0]).astype(jnp.int32), 1), (2, 4)), (6, 10)),
    "dynamic_update_slice": (lambda x: lax.dynamic_update_slice(
        x, -x[:2, :3], (jnp.argmax(x[:, 0]).astype(jnp.int32), 4)), (6, 10)),
    "cumsum_rev": (lambda x: jnp.flip(jnp.cumsum(jnp.flip(x, 1), 1), 1),
                   (6, 10)),
    "scalar_index": (lambda x: x[2] * x[:, 3].sum(), (6, 10)),
    "take_rows": (lambda x: x[jnp.array([4, 0, 2])] + x[:, jnp.array([9, 1])
                                                         ].sum(), (6, 10)),
    "tile": (lambda x: jnp.tile(x, (2, 3)), (3, 5)),
    "unstack": (lambda x: sum(jnp.unstack(x, axis=1)), (6, 5)),
    "repeat": (lambda x: jnp.repeat(x, 2, axis=1), (3, 5)),
}


@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
def test_shape_ops(name):
  fn, shape = SHAPE_OPS[name]
  x = array(12, shape, jnp.float32)
  got, want = _whole(fn, x)
  assert_close(got, want)


# ------------------------------------------------------------------ dots

@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (8, 8, 8), (4, 24, 40),
                                   (32, 5, 3), (1, 16, 7)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dot_pads_small_and_odd_dims(m, k, n, dtype):
  a, b = array(13, (m, k), dtype), array(14, (k, n), dtype)

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...],
                         preferred_element_type=jnp.float32)
  got = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), a, b)
  want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  assert_close(got, want, tol=1e-4 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("case", ["nt", "tn", "batched", "matvec", "int8",
                                  "int32", "bf16_out"])
def test_dot_general_forms(case):
  if case == "nt":
    a, b = array(15, (16, 32), jnp.float32), array(16, (24, 32), jnp.float32)
    fn = lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())))
  elif case == "tn":
    a, b = array(15, (32, 16), jnp.float32), array(16, (32, 24), jnp.float32)
    fn = lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ())))
  elif case == "batched":
    a, b = array(15, (2, 16, 8), jnp.float32), array(16, (2, 8, 16), jnp.float32)
    fn = lambda a, b: jnp.einsum("bik,bkj->bij", a, b)
  elif case == "matvec":
    a, b = array(15, (16, 32), jnp.float32), array(16, (32,), jnp.float32)
    fn = jnp.dot
  elif case == "int8":
    a, b = array(15, (16, 32), jnp.int8, -5, 5), array(16, (32, 16), jnp.int8,
                                                      -5, 5)
    fn = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32)
  elif case == "int32":
    a, b = array(15, (8, 12), jnp.int32, -5, 5), array(16, (12, 4), jnp.int32,
                                                      -5, 5)
    fn = jnp.dot
  else:
    a, b = array(15, (16, 32), jnp.bfloat16), array(16, (32, 16), jnp.bfloat16)
    fn = jnp.dot

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = fn(a_ref[...], b_ref[...]).astype(o_ref.dtype)
  want = fn(a, b)
  got = call(kernel, jax.ShapeDtypeStruct(want.shape, want.dtype), a, b)
  assert_close(got, want, want.dtype, tol=1e-4 if want.dtype == jnp.float32
               else None)


def test_triton_dot_helper_and_transposes():
  a, b = array(17, (16, 32), jnp.float32), array(18, (16, 32), jnp.float32)

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = plt.dot(a_ref[...], b_ref[...], trans_b=True, allow_tf32=False)
  got = call(kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32), a, b)
  assert_close(got, a @ b.T, tol=1e-4)


# ------------------------------------------------------------------ control flow

def test_switch_fori_while_and_when():
  x = array(19, (8,), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(i, acc):
      branch = lax.switch(i % 3, [lambda: x_ref[i], lambda: -x_ref[i],
                                  lambda: 2 * x_ref[i]])
      return acc + branch
    total = lax.fori_loop(0, 8, body, jnp.float32(0))
    n = lax.while_loop(lambda c: c[0] < total * 0 + 5,
                       lambda c: (c[0] + 1, c[1] * 2), (0, jnp.float32(1)))[1]

    @pl.when(total > -100)
    def _():
      o_ref[0] = total
    o_ref[1] = n
  got = call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), x)
  signs = jnp.array([1, -1, 2, 1, -1, 2, 1, -1], jnp.float32)
  assert_close(got[0], jnp.sum(x * signs), tol=1e-5)
  assert got[1] == 32.0


def test_fori_loop_with_dynamic_bounds_and_unroll():
  x = array(20, (16,), jnp.float32)

  def kernel(n_ref, x_ref, o_ref):
    n = n_ref[0]
    acc = lax.fori_loop(0, n, lambda i, a: a + x_ref[i], jnp.float32(0))
    acc2 = lax.fori_loop(0, 4, lambda i, a: a * 2 + x_ref[i], jnp.float32(0),
                         unroll=True)
    o_ref[0] = acc
    o_ref[1] = acc2
  got = call(kernel, jax.ShapeDtypeStruct((2,), jnp.float32),
             jnp.array([5], jnp.int32), x)
  assert_close(got[0], x[:5].sum())
  want = 0.0
  for i in range(4):
    want = want * 2 + x[i]
  assert_close(got[1], want)


# ------------------------------------------------------------------ refs

def test_dynamic_ds_slices_and_integer_indices():
  x = array(21, (8, 16), jnp.float32)

  def kernel(x_ref, o_ref):
    @pl.loop(0, 4)
    def _(k):
      start = pl.multiple_of(k * 4, 4)
      o_ref[pl.ds(2 * k, 2), pl.ds(start, 4)] = x_ref[pl.ds(2 * k, 2),
                                                      pl.ds(start, 4)] + k
    o_ref[7, 0] = x_ref[0, 15]
    row = x_ref.at[3]
    o_ref[6, 8:16] = row[pl.ds(0, 8)]
  got = call(kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), x)
  want = jnp.full((8, 16), jnp.nan)     # never written: poison
  for k in range(4):
    want = want.at[2 * k:2 * k + 2, 4 * k:4 * k + 4].set(
        x[2 * k:2 * k + 2, 4 * k:4 * k + 4] + k)
  want = want.at[7, 0].set(x[0, 15]).at[6, 8:16].set(x[3, :8])
  assert_close(got, want)


def test_scratch_partial_writes_and_reads():
  x = array(22, (6, 8), jnp.float32)

  def kernel(x_ref, o_ref, acc_ref):
    acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[1:4, :] = x_ref[0:3, :]
    acc_ref[5] = x_ref[5] * 2
    acc_ref[:, 2:4] += 1.0
    plt.store(acc_ref.at[0], x_ref[4], mask=jnp.arange(8) < 3)
    o_ref[...] = acc_ref[...] + acc_ref[2, 3]
  got = call(kernel, jax.ShapeDtypeStruct((6, 8), jnp.float32), x,
             scratch_shapes=[pltpu.VMEM((6, 8), jnp.float32)])
  acc = jnp.zeros((6, 8)).at[1:4].set(x[0:3]).at[5].set(x[5] * 2)
  acc = acc.at[:, 2:4].add(1.0).at[0, :3].set(x[4, :3])
  assert_close(got, acc + acc[2, 3])


def test_masked_load_with_other_on_partial_blocks():
  x = array(23, (50,), jnp.float32)

  def kernel(x_ref, o_ref):
    offs = jnp.arange(16)
    v = plt.load(x_ref, mask=offs % 2 == 0, other=-1.0)
    plt.store(o_ref, v * 2, mask=offs < 12)
  got = call(kernel, jax.ShapeDtypeStruct((50,), jnp.float32), x,
             grid=(4,), in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
             out_specs=pl.BlockSpec((16,), lambda i: (i,)))
  offs = np.arange(64) % 16
  xp = np.pad(np.asarray(x), (0, 14))
  # the lanes the store masks off are never written: poison
  want = np.where(offs < 12, np.where(offs % 2 == 0, xp, -1.0) * 2,
                  np.nan)[:50]
  assert_close(got, want)


@pytest.mark.parametrize("op", ["add", "max", "min", "xchg", "and", "or", "xor"])
def test_atomics_on_blocks(op):
  idx = jnp.array([0, 3, 3, 1, 2, 2, 2, 0], jnp.int32)
  fn = getattr(plt, f"atomic_{op}")

  combine = {"add": np.add, "max": np.maximum, "min": np.minimum,
             "xchg": lambda a, b: b, "and": np.bitwise_and,
             "or": np.bitwise_or, "xor": np.bitwise_xor}[op]

  def kernel2(i_ref, o_ref, old_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.full(o_ref.shape, 5, jnp.int32)
    old_ref[...] = fn(o_ref, pl.ds(0, 4), i_ref[...] + 1)
  o, old = call(kernel2, (jax.ShapeDtypeStruct((4,), jnp.int32),
                          jax.ShapeDtypeStruct((8,), jnp.int32)), idx,
                grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                out_specs=[pl.BlockSpec((4,), lambda i: (0,)),
                           pl.BlockSpec((4,), lambda i: (i,))])
  state = np.full(4, 5, np.int32)
  olds = []
  for step in range(2):
    v = np.asarray(idx[4 * step:4 * step + 4]) + 1
    olds.append(state.copy())
    state = combine(state, v).astype(np.int32)
  np.testing.assert_array_equal(o, state)
  np.testing.assert_array_equal(old, np.concatenate(olds))


def test_grid_of_rank_four_is_flattened():
  x = array(24, (2, 3, 4, 40), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 10 * pl.program_id(1)
                               + 100 * pl.program_id(2) + pl.program_id(3))
  got = call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32), x,
             grid=(2, 3, 4, 5),
             in_specs=[pl.BlockSpec((None, None, None, 8),
                                    lambda a, b, c, d: (a, b, c, d))],
             out_specs=pl.BlockSpec((None, None, None, 8),
                                    lambda a, b, c, d: (a, b, c, d)))
  a = jnp.arange(2)[:, None, None, None]
  b = jnp.arange(3)[None, :, None, None]
  c = jnp.arange(4)[None, None, :, None]
  d = jnp.repeat(jnp.arange(5), 8)[None, None, None, :]
  assert_close(got, x * (a + 10 * b + 100 * c + d))


def test_element_dims_with_padding():
  x = array(25, (20,), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  got = call(kernel, jax.ShapeDtypeStruct((24,), jnp.float32), x, grid=(3,),
             in_specs=[pl.BlockSpec((pl.Element(8, (2, 6)),),
                                    lambda i: (i * 8,))],
             out_specs=pl.BlockSpec((8,), lambda i: (i,)))
  # Element padding reads poison (NaN), as in Pallas's interpret mode.
  want = jnp.pad(x, (2, 6), constant_values=jnp.nan)[:24]
  assert_close(got, want)


# ------------------------------------------------------------------ transformations

def _sin_x(x_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) * x_ref[...]


def _sin_x_call(x):
  return pl.pallas_call(_sin_x, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                        backend="triton_interpret")(x)


def test_vmap_grad_and_shard_map_of_a_triton_kernel():
  x = jnp.linspace(-2.0, 2.0, 16)
  ref = lambda x: jnp.sin(x) * x
  xs = jnp.stack([x, 2 * x])
  assert_close(jax.jit(jax.vmap(_sin_x_call))(xs), jax.vmap(ref)(xs))
  assert_close(jax.jit(jax.grad(lambda x: _sin_x_call(x).sum()))(x),
               jax.grad(lambda x: ref(x).sum())(x))
  n = min(4, len(jax.devices()))
  if n < 2:
    pytest.skip("needs several (host) devices")
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
  xl = jnp.linspace(-2.0, 2.0, 16 * n)
  g = jax.jit(jax.shard_map(_sin_x_call, mesh=mesh, in_specs=P("d"),
                            out_specs=P("d")))
  assert_close(g(xl), ref(xl))


# ------------------------------------------------------------------ hypothesis

@SETTINGS
@given(m=st.integers(1, 40), n=st.integers(1, 40), bm=st.integers(1, 24),
       bn=st.integers(1, 24),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32]))
def test_blocked_rowwise_normalize(m, n, bm, bn, dtype):
  """Non-power-of-two and partial blocks: row sums over masked lanes."""
  bm, bn = min(bm, m), n      # whole rows per block
  x = array(m * 100 + n, (m, n), dtype, -5, 5)

  def kernel(x_ref, o_ref):
    v = x_ref[...].astype(jnp.float32)
    o_ref[...] = (v - jnp.max(v, axis=1, keepdims=True) +
                  jnp.sum(v, axis=1, keepdims=True)).astype(o_ref.dtype)
  got = call(kernel, jax.ShapeDtypeStruct((m, n), dtype), x,
             grid=(pl.cdiv(m, bm),),
             in_specs=[pl.BlockSpec((bm, bn), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((bm, bn), lambda i: (i, 0)))
  v = x.astype(jnp.float32)
  want = (v - v.max(1, keepdims=True) + v.sum(1, keepdims=True)).astype(dtype)
  assert_close(got, want, dtype, tol=2e-2 if dtype == jnp.bfloat16 else 1e-5)


@SETTINGS
@given(m=st.integers(1, 24), k=st.integers(1, 24), n=st.integers(1, 24))
def test_small_matmul_any_shape(m, k, n):
  a, b = array(m, (m, k), jnp.float32), array(n, (k, n), jnp.float32)

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...],
                         preferred_element_type=jnp.float32)
  got = call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), a, b)
  assert_close(got, a @ b, tol=1e-4)


# ------------------------------------------------------------------ AOT

_FP8_SM89 = {jnp.dtype(jnp.float8_e4m3fn)}    # Triton's fp8e4nv needs sm_89+
# float8_e5m2 compiles for sm_80, but after an sm_89+ compile in the same
# process Triton 3.6 may emit sm_89 conversions for it: not checked on sm_80.
_FP8_SM80_UNCHECKED = {jnp.dtype(jnp.float8_e5m2)}


@pytest.mark.parametrize("arch", TRITON_ARCHS)
@pytest.mark.parametrize("name,kwargs", list(test_cases(
    sys.modules[__name__], slow_after_first=True)))
def test_kernels_compile_ahead_of_time(name, kwargs, arch):
  """Every kernel above also compiles for sm_90 (the first case of each
  test in the default suite, every case and sm_80 too with -m slow;
  float8_e4m3fn needs sm_89+: on sm_80 it is a clear BackendError)."""
  with default_backend() as lowered:
    globals()[name](**kwargs)
  assert lowered
  dts = {jnp.dtype(v) for v in kwargs.values()
         if isinstance(v, type) or hasattr(v, "dtype")}
  fp8 = bool(dts & _FP8_SM89)
  skip_sm80 = bool(dts & _FP8_SM80_UNCHECKED)
  seen = set()
  for spec in lowered:
    gk = lowering_triton.generate(spec)
    if gk.source in seen:
      continue
    seen.add(gk.source)
    if skip_sm80 and arch == "sm_80":
      continue
    if fp8 and arch == "sm_80":
      with pytest.raises(pl.BackendError, match="Triton failed to compile"):
        compile_kernel(gk, 80)
      continue
    assert compile_kernel(gk, int(arch[3:])).asm["cubin"]
