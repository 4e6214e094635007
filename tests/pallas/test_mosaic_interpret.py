"""What only `mosaic_interpret` has: TPU operations (roll, repeat, bitcast)
against the interpret backend and Pallas's TPU interpret mode, and the
Mosaic interpreter's report of an out-of-bounds access. The core DSL's
features run on every CPU backend in test_features.py."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas.testing import assert_close

MI = "mosaic_interpret"


def test_roll_repeat_bitcast_match_interpret_backend():
  def kernel(x_ref, s_ref, r_ref, p_ref, b_ref):
    x = x_ref[...]
    r_ref[...] = pltpu.roll(x, 3, 1) + pltpu.roll(x, s_ref[0], 0)
    p_ref[...] = pltpu.repeat(x, 2, 1)
    b_ref[...] = pltpu.bitcast(x, jnp.int32)
  x = jax.random.normal(jax.random.key(9), (8, 128))
  shift = jnp.array([5], jnp.int32)
  outs = (jax.ShapeDtypeStruct((8, 128), jnp.float32),
          jax.ShapeDtypeStruct((8, 256), jnp.float32),
          jax.ShapeDtypeStruct((8, 128), jnp.int32))
  specs = [pl.BlockSpec(), pl.BlockSpec(memory_space=pltpu.SMEM)]
  got = pl.pallas_call(kernel, outs, in_specs=specs, backend=MI)(x, shift)
  ref = pl.pallas_call(kernel, outs, in_specs=specs,
                       backend="interpret")(x, shift)
  assert_close(got[0], jnp.roll(x, 3, 1) + jnp.roll(x, 5, 0))
  assert_close(got[1], jnp.tile(x, (1, 2)))
  np.testing.assert_array_equal(got[2], jax.lax.bitcast_convert_type(
      x, jnp.int32))
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(g, r)


def test_bitcast_between_widths_round_trips():
  def kernel(x_ref, o_ref, back_ref):
    y = pltpu.bitcast(x_ref[...], jnp.bfloat16)
    o_ref[...] = y
    back_ref[...] = pltpu.bitcast(y, jnp.int32)
  x = jax.random.randint(jax.random.key(10), (8, 128), 0, 1 << 30, jnp.int32)
  outs = (jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((8, 128), jnp.int32))
  got = pl.pallas_call(kernel, outs, backend=MI)(x)
  ref = pl.pallas_call(kernel, outs, backend="interpret")(x)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16),
                                np.asarray(ref[0]).view(np.uint16))
  np.testing.assert_array_equal(got[1], x)


def test_element_padding_reads_poison():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.arange(8 * 896, dtype=jnp.float32).reshape(8, 896)
  padded = [pl.BlockSpec((8, pl.Element(128, (5, 0))), lambda i: (0, i * 128))]
  got = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
      in_specs=padded, out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)),
      backend=MI)(x)
  np.testing.assert_array_equal(got[:, 5:], x[:, :507])
  assert np.isnan(got[:, :5]).all()


def test_out_of_bounds_access_is_reported_with_its_line():
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[pl.ds(i * 8, 8)]        # i = 1 reads rows 8:16 of 8
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                     backend=MI)
  from lowering_mosaic.verification import interpreter
  # a window placed at run time outside its ref reads poison (NaN) ...
  assert np.isnan(np.asarray(f(jnp.ones((8, 128))))).all()
  # ... and with runtime asserts it is an error naming the line
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises(Exception, match=r"out-of-bounds load from "
                       r"x_ref\[8:16, :\]"):
      jax.block_until_ready(f(jnp.ones((8, 128))))
  err = interpreter.last_failure()
  assert "rows 8:16" in open(__file__).read().splitlines()[
      int(err.lines[0].rsplit(":", 1)[1]) - 1]


def test_roll_and_bitcast_agree_with_pallas_tpu():
  jpl = pytest.importorskip("jax.experimental.pallas")
  jtpu = pytest.importorskip("jax.experimental.pallas.tpu")

  def body(mod_tpu):
    def kernel(x_ref, r_ref, b_ref):
      r_ref[...] = mod_tpu.roll(x_ref[...], 3, 1)
      b_ref[...] = mod_tpu.bitcast(x_ref[...], jnp.bfloat16)
    return kernel
  x = jax.random.randint(jax.random.key(0), (8, 128), 0, 1 << 30, jnp.int32)
  outs = (jax.ShapeDtypeStruct((8, 128), jnp.int32),
          jax.ShapeDtypeStruct((16, 128), jnp.bfloat16))
  theirs = jpl.pallas_call(body(jtpu), outs, interpret=True)(x)
  ours = pl.pallas_call(body(pltpu), outs, backend=MI)(x)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                  np.asarray(b).view(np.uint16))


def test_sigmoid_of_a_scalar():
  """`tpu.logistic` takes vectors only: a scalar's sigmoid is spelled
  1 / (1 + exp(-x)) (found by the fuzzer, case 701:121)."""
  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * jax.nn.sigmoid(s_ref[0])
  s = jnp.array([0.3], jnp.float32)
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec((8, 128), lambda: (0, 0))],
      backend="mosaic_interpret")(s, x)
  np.testing.assert_allclose(out, x * jax.nn.sigmoid(0.3), rtol=1e-6)


def test_import_dsl_defines_the_interpreter_options_state():
  """The mosaic_interpret backend's option state is part of JAX's trace
  context; were it defined when the interpreter first runs, every function
  jitted before would be traced again (a cache miss per kernel)."""
  code = ("import jax; from jax._src import config as c; import dsl; "
          "print('jax_mosaic_interpret_options' in jax.config.values, "
          "len(c.trace_context()))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout.split()
  assert out[0] == "True"


def test_first_mosaic_interpret_run_keeps_jit_cache():
  traces = []

  @jax.jit
  def f(x):
    traces.append(x)
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        backend="mosaic_interpret")(x)
  for k in range(2):
    f(jnp.full((8, 128), float(k), jnp.float32))
  assert len(traces) == 1
