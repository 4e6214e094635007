"""Cases where backend="triton_interpret" gave a silent wrong answer, touched
memory outside a buffer or crashed: each kernel runs on triton_interpret and
is compared with a plain jax.numpy reference, with backend="interpret" and,
where Pallas runs the same kernel, with jax.experimental.pallas in interpret
mode. The generated source must also compile for GPUs (the same formulations
run there)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from dsl.core.jax_internals import config as jax_config
from jax.experimental import pallas as jpl

import dsl as pl
import lowering_triton
from dsl.core.poison import poison_value
from lowering_triton.compile import compile_kernel
from tests.pallas.testing import assert_all_equal, run_backends

BACKEND = "triton_interpret"  # the Triton backend these tests run on the CPU
# The backends each kernel runs on (and Pallas, where it runs the kernel).
COMPARED = (BACKEND, "interpret")

S = jax.ShapeDtypeStruct


def _kernel_specs(f, *args):
  return lowering_triton.aot.kernel_specs(f, *args)


# ------------------------------------------------------------------ dots

@pytest.mark.parametrize("in_dtype,out_dtype,value", [
    (jnp.int8, jnp.int32, 100),             # 32 * 100 * 100 = 320000
    (jnp.int8, jnp.int16, 100),             # wraps at 16 bits, not 8
    (jnp.float16, jnp.float32, 1.015625),   # 1 + 2**-6
])
def test_dot_multiplies_in_the_result_type(in_dtype, out_dtype, value):
  x = jnp.full((16, 32), value, in_dtype)
  y = jnp.full((32, 16), value, in_dtype).at[0, 1].set(-value)

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...],
                         preferred_element_type=o_ref.dtype)

  got = run_backends(COMPARED, kernel, S((16, 16), out_dtype), x, y)
  if jnp.issubdtype(in_dtype, jnp.integer):
    assert_all_equal(got, jnp.dot(x, y, preferred_element_type=out_dtype))
    return
  # 32 products of (1 + 2**-6)**2 sum to 33.0078125, exact in float32; in
  # float16 (spacing 2**-5 at 32) the sum would round to 33.
  exact = np.matmul(np.asarray(x, np.float64), np.asarray(y, np.float64))
  assert exact[0, 0] == 33.0078125
  for backend, out in got.items():
    np.testing.assert_allclose(np.asarray(out), exact, rtol=2e-6,
                               err_msg=backend)


def test_int8_dot_with_short_k_compiles_for_gpus():
  """8-bit tl.dot needs K >= 32 on GPUs; a K of 16 is padded."""
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...],
                         preferred_element_type=jnp.int32)

  x = jnp.full((16, 16), 100, jnp.int8)
  f = pl.pallas_call(kernel, S((16, 16), jnp.int32), backend=BACKEND)
  np.testing.assert_array_equal(f(x, x), jnp.full((16, 16), 160000))
  (spec,) = _kernel_specs(f, x, x)
  gk = lowering_triton.generate(spec)
  assert "K >= 32: padded K 16->32" in gk.source
  assert compile_kernel(gk, 90).asm["cubin"]


# ------------------------------------------------------------------ NaN

def _with_nans(shape):
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) - 7
  return x.at[0, 3].set(jnp.nan).at[1, 5].set(jnp.nan).at[1, 2].set(jnp.nan)


REDUCTIONS = {
    "max": lambda v: jnp.max(v, axis=1),
    "min": lambda v: jnp.min(v, axis=1),
    "argmax": lambda v: jnp.argmax(v, axis=1).astype(jnp.int32),
    "argmin": lambda v: jnp.argmin(v, axis=1).astype(jnp.int32),
    "max_all": lambda v: jnp.max(v)[None],
    "cummax": lambda v: lax.cummax(v, axis=1),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("shape,dtype", [((2, 8), jnp.float32),
                                         ((3, 6), jnp.bfloat16)])
def test_reductions_propagate_nan(name, shape, dtype):
  fn = REDUCTIONS[name]
  x = _with_nans(shape).astype(dtype)
  want = fn(x)

  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])

  got = run_backends(COMPARED, kernel, S(want.shape, want.dtype), x)
  assert_all_equal(got, want)


def test_elementwise_extremes_propagate_nan_and_order_signed_zeros():
  a = jnp.array([0., -0., 0., -0., 1., jnp.nan, 2., jnp.nan], jnp.float32)
  b = jnp.array([-0., 0., 0., -0., jnp.nan, 1., 3., 5.], jnp.float32)

  def kernel(a_ref, b_ref, o_ref):
    x, y = a_ref[...], b_ref[...]
    # 1 / x tells +0.0 (inf) from -0.0 (-inf).
    o_ref[0] = 1.0 / jnp.maximum(x, y)
    o_ref[1] = 1.0 / jnp.minimum(x, y)
    o_ref[2] = jnp.clip(x, -0.5, 0.5)
    o_ref[3] = 1.0 / jnp.max(jnp.stack([x, y]), axis=0)
    o_ref[4] = 1.0 / jnp.min(jnp.stack([x, y]), axis=0)

  want = jnp.stack([1 / jnp.maximum(a, b), 1 / jnp.minimum(a, b),
                    jnp.clip(a, -0.5, 0.5), 1 / jnp.max(jnp.stack([a, b]), 0),
                    1 / jnp.min(jnp.stack([a, b]), 0)])
  assert_all_equal(
      run_backends(COMPARED, kernel, S((5, 8), jnp.float32), a, b), want)


def test_nan_combine_helpers_match_their_numpy_fast_path(monkeypatch):
  """The interpreter runs the NaN-propagating combine helpers with numpy;
  run element by element instead, the helpers give the same answers."""
  from lowering_triton.rules import reductions
  x = _with_nans((2, 8)).at[0, 0].set(-0.0).at[0, 1].set(0.0)
  names = ("max", "min", "argmax", "argmin")

  def kernel(x_ref, *o_refs):
    for name, o_ref in zip(names, o_refs):
      o_ref[...] = REDUCTIONS[name](x_ref[...])

  out_shape = [S((2,), jnp.float32)] * 2 + [S((2,), jnp.int32)] * 2
  f = pl.pallas_call(kernel, out_shape, backend=BACKEND)
  fast = f(x)
  for name in list(reductions.NAN_REDUCTIONS):
    monkeypatch.delitem(reductions.NAN_REDUCTIONS, name)
  jax.clear_caches()
  slow = f(x)
  for a, b, name in zip(fast, slow, names):
    np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(a, REDUCTIONS[name](x), err_msg=name)


# ------------------------------------------------------------------ integers

def _divisors(dtype):
  signed = jnp.issubdtype(dtype, jnp.signedinteger)
  info = jnp.iinfo(dtype)
  x = jnp.array([7, -7 if signed else 200, 0, info.min, 9, 5, 6, -9 if signed
                 else 9], dtype)
  y = jnp.array([0, 0, 0, -1 if signed else 1, 2, 0, -1 if signed else 3, 4],
                dtype)
  return x, y


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8,
                                   jnp.uint32])
def test_integer_division_by_zero_and_overflow_as_jnp(dtype):
  x, y = _divisors(dtype)
  ops = (lax.div, lax.rem, jnp.floor_divide, jnp.remainder)

  def kernel(x_ref, y_ref, o_ref):
    for k, op in enumerate(ops):
      o_ref[k] = op(x_ref[...], y_ref[...])

  want = jnp.stack([jax.jit(op)(x, y) for op in ops])
  assert_all_equal(run_backends(COMPARED, kernel, S((4, 8), dtype), x, y), want)


_SPECIAL = [np.nan, np.inf, -np.inf, 3e9, -3e9, 1e20, 300.7, -1.5]


@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dst", [jnp.int8, jnp.int32, jnp.uint8, jnp.uint32,
                                 jnp.bool_])
def test_float_to_int_casts_saturate_as_jnp(src, dst):
  x = jnp.array(_SPECIAL, src)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(dst)

  want = jax.jit(lambda v: v.astype(dst))(x)
  assert_all_equal(run_backends(COMPARED, kernel, S(x.shape, dst), x), want)


INT_DTYPES = [jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16,
              jnp.uint32]
BIT_OPS = {
    "not": lambda a, s: ~a,
    "neg": lambda a, s: -a,
    "abs": lambda a, s: jnp.abs(a),
    "sign": lambda a, s: jnp.sign(a),
    "shl": lax.shift_left,
    "shr_arithmetic": lax.shift_right_arithmetic,
    "shr_logical": lax.shift_right_logical,
    "shl_const": lambda a, s: a << 3,
    "shr_const_past_width": lambda a, s: lax.shift_right_arithmetic(
        a, jnp.array(40, a.dtype) if a.dtype.itemsize > 1 else
        jnp.array(9, a.dtype)),
}


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_bit_operations_as_jnp(dtype):
  info = jnp.iinfo(dtype)
  bits = jnp.dtype(dtype).itemsize * 8
  x = jnp.array([0, 1, 5, info.max, info.min, info.max - 1, 3, 100], dtype)
  shift = np.array([0, 1, bits, 3, 1, bits - 1, bits + 1, 7])
  if info.min < 0:
    shift[6] = -1
  s = jnp.asarray(shift).astype(dtype)
  names = sorted(BIT_OPS)

  def kernel(x_ref, s_ref, o_ref):
    for k, name in enumerate(names):
      o_ref[k] = BIT_OPS[name](x_ref[...], s_ref[...]).astype(o_ref.dtype)

  want = jnp.stack([jax.jit(BIT_OPS[n])(x, s).astype(dtype) for n in names])
  assert_all_equal(
      run_backends(COMPARED, kernel, S((len(names), 8), dtype), x, s), want)


def test_bool_not():
  x = jnp.array([True, False, True, True])

  def kernel(x_ref, o_ref):
    o_ref[...] = ~x_ref[...]

  assert_all_equal(run_backends(COMPARED, kernel, S((4,), jnp.bool_), x), ~x)


# ------------------------------------------------------------------ indices

def test_negative_static_indices_count_from_the_end():
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[0] = x_ref[-1]
    o_ref[1, :2] = x_ref[1:-1, -3]
    o_ref[-1] = x_ref[-2]
    o_ref[-2, -1] = x_ref[-4, -8]

  want = jnp.zeros((4, 8)).at[0].set(x[-1]).at[1, :2].set(x[1:-1, -3])
  want = want.at[-1].set(x[-2]).at[-2, -1].set(x[-4, -8])
  assert_all_equal(
      run_backends(COMPARED, kernel, S((4, 8), jnp.float32), x), want)


def test_negative_static_indices_on_scratch():
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)

  def kernel(x_ref, o_ref):
    def body(s_ref):
      s_ref[...] = x_ref[...]
      s_ref[-1] = jnp.full((8,), 7.0)
      s_ref[0, -1] = 9.0
      o_ref[...] = s_ref[...]
      o_ref[1] = s_ref[-1]
    pl.run_scoped(body, pl.tpu.VMEM((4, 8), jnp.float32))

  want = x.at[-1].set(7.0).at[0, -1].set(9.0).at[1].set(7.0)
  got = run_backends(COMPARED, kernel, S((4, 8), jnp.float32), x, pallas=False)
  assert_all_equal(got, want)


# ------------------------------------------------------------------ GPU

def test_guarded_formulations_compile_for_gpus():
  """The NaN-propagating reductions, division guards, saturating casts and
  shift guards compile for sm_80 and sm_90."""
  def kernel(x_ref, a_ref, b_ref, f_ref, i_ref):
    v, a, b = x_ref[...], a_ref[...], b_ref[...]
    f_ref[...] = jnp.max(v, axis=1) + jnp.min(v, axis=1)
    i_ref[...] = (jnp.argmax(v, axis=1).astype(jnp.int32)
                  + v.astype(jnp.int32)[:, 0] + v.astype(jnp.uint8)[:, 0]
                  + (lax.div(a, b) + lax.rem(a, b) + (a << b)
                     + lax.shift_right_arithmetic(a, b)
                     + lax.shift_right_logical(a, b) + ~a)[:, 0])

  x = jnp.ones((4, 8), jnp.float32)
  a = jnp.ones((4, 8), jnp.int32)
  f = pl.pallas_call(kernel, (S((4,), jnp.float32), S((4,), jnp.int32)),
                     backend=BACKEND)
  (spec,) = _kernel_specs(f, x, a, a)
  gk = lowering_triton.generate(spec)
  for arch in (80, 90):
    assert ".entry" in compile_kernel(gk, arch).asm["ptx"]


# ------------------------------------------------------------------ padding

def _edge_specs(module):
  """Blocks of 4 over an array of 5: the second block is partial."""
  return dict(grid=(2,), in_specs=[module.BlockSpec((4,), lambda i: (i,))],
              out_specs=module.BlockSpec((4,), lambda i: (i,)))


@pytest.mark.parametrize("dtype,poison", [
    (jnp.float32, np.nan), (jnp.bfloat16, np.nan),
    (jnp.int32, poison_value(np.int32)), (jnp.int8, poison_value(np.int8))])
def test_reads_past_the_array_see_poison(dtype, poison):
  """The lanes of an edge block past the array read poison (NaN, an odd
  integer near the minimum: memory that holds garbage on a GPU), as in
  Pallas's interpret mode, not zeros that would hide a reduction over
  padding."""
  x = jnp.arange(1, 6).astype(dtype)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.max(x_ref[...]), (4,))

  f = pl.pallas_call(kernel, S((5,), dtype), backend=BACKEND,
                     **_edge_specs(pl))
  got = np.asarray(f(x).astype(jnp.float32))
  np.testing.assert_array_equal(got[:4], 4.0)
  want = 5.0 if not np.isnan(poison) else np.nan
  np.testing.assert_array_equal(got[4], want)
  if np.isnan(poison):
    p = jpl.pallas_call(kernel, S((5,), dtype), interpret=True,
                        **_edge_specs(jpl))(x)
    np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32)), got)


def test_integer_sum_over_poison_wraps_instead_of_crashing():
  x = jnp.arange(1, 6, dtype=jnp.int32)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...]), (4,))

  f = pl.pallas_call(kernel, S((5,), jnp.int32), backend=BACKEND,
                     **_edge_specs(pl))
  got = np.asarray(f(x))
  np.testing.assert_array_equal(got[:4], 10)
  # 5 + 3 * poison, wrapped to 32 bits.
  want = (5 + 3 * poison_value(np.int32)) % 2 ** 32
  assert got[4] == np.uint32(want).view(np.int32)


def test_padding_written_then_read_back_is_poison():
  """Writes to the part of an edge block past the array are dropped, so
  reading them back sees poison: the in-bounds lane of the edge block is
  NaN, never a silently wrong number (zeros read back gave 1)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.ones((4,), jnp.float32)
    o_ref[0] = jnp.sum(o_ref[...])

  x = jnp.ones((5,), jnp.float32)
  f = pl.pallas_call(kernel, S((5,), jnp.float32), backend=BACKEND,
                     **_edge_specs(pl))
  np.testing.assert_array_equal(f(x), [4.0, 1.0, 1.0, 1.0, np.nan])


def test_masked_load_other_fills_only_lanes_the_mask_drops():
  """`other` fills the lanes the user's mask drops; lanes the mask keeps
  but the array lacks read poison."""
  from dsl import triton as plt

  def kernel(x_ref, o_ref):
    keep = jnp.arange(4) < 2
    o_ref[...] = plt.load(x_ref.at[pl.ds(0, 4)], mask=keep, other=-1.0)

  x = jnp.arange(1.0, 6.0)
  f = pl.pallas_call(kernel, S((8,), jnp.float32), backend=BACKEND,
                     grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                     out_specs=pl.BlockSpec((4,), lambda i: (i,)))
  got = np.asarray(f(x))
  np.testing.assert_array_equal(got, [1, 2, -1, -1, 5, np.nan, -1, -1])


@pytest.mark.parametrize("poison_buffers", [False, True])
def test_scratch_and_run_scoped_start_as_poison_when_asked(poison_buffers):
  from dsl import tpu as pltpu

  def kernel(x_ref, o_ref, f_ref, i_ref):
    o_ref[0] = f_ref[1] + x_ref[0]
    o_ref[1] = i_ref[2].astype(jnp.float32)

    def body(s_ref):
      o_ref[2] = s_ref[3]
    pl.run_scoped(body, pltpu.VMEM((4,), jnp.float32))

  x = jnp.ones((3,), jnp.float32)
  f = pl.pallas_call(kernel, S((3,), jnp.float32), backend=BACKEND,
                     scratch_shapes=[pltpu.VMEM((4,), jnp.float32),
                                     pltpu.VMEM((4,), jnp.int32)])
  with jax_config.jax_pallas_poison_buffers(poison_buffers):
    got = np.asarray(jax.jit(f)(x))
  want = [np.nan, -2.0 ** 31, np.nan] if poison_buffers else [1.0, 0.0, 0.0]
  np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ blocks

_OUT_OF_RANGE_BLOCKS = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
import dsl as pl
from dsl import tpu as pltpu
from dsl.core.jax_internals import config as jax_config

def kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1

# Block indices read from data: rows 5, -3 and 10**6 of a 4-row array.
idx = jnp.array([0, 5, -3, 1000000, 2], jnp.int32)
x = jnp.arange(32.0).reshape(4, 8)
spec = lambda: pl.BlockSpec((1, 8), lambda i, idx_ref: (idx_ref[i], 0))
grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1, grid=(5,), in_specs=[spec()], out_specs=spec())
f = lambda: pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32),
                           grid_spec=grid_spec, backend="triton_interpret")
result = {"out": np.asarray(jax.jit(f())(idx, x)).tolist()}
with jax_config.config._value_holders["jax_pallas_enable_runtime_assert"](True):
  try:
    jax.jit(f())(idx, x).block_until_ready()
    result["error"] = None
  except Exception as e:
    result["error"] = str(e)
print("RESULT " + json.dumps(result))
'''


def test_block_indices_read_from_data_never_leave_the_buffer():
  """Out-of-range block indices from scalar prefetch read poison and drop
  their writes (before, the generated code read and wrote outside the
  buffers: heap corruption, exit 139); with runtime asserts on they fail
  a check naming the operand. Run in a subprocess so that a regression
  cannot take pytest down."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_BLOCKS],
                        cwd=root, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  line = next(ln for ln in proc.stdout.splitlines()
              if ln.startswith("RESULT "))
  result = json.loads(line[len("RESULT "):])
  x = np.arange(32.0).reshape(4, 8)
  want = np.full((4, 8), np.nan)              # rows 1 and 3: never written
  want[0], want[2] = x[0] + 1, x[2] + 1
  np.testing.assert_array_equal(result["out"], want)
  assert ("in_specs[0]: block index (5, 0) at grid point (1,) is outside the "
          "array float32[4,8]") in result["error"]
  assert "not element offsets" in result["error"]
