"""The Triton backends' debugging aids and errors: device prints and
asserts, the source dump, unsupported primitives named with the kernel and
the user's line, verbose errors marking the failing equation."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
import lowering_triton
from dsl import triton as plt
from dsl import tpu as pltpu
from tests.pallas import testing
from tests.pallas.testing import array, assert_close, call


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def blocked_add(x, y, block=128, **kw):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(x.shape[0], block),),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
      out_specs=pl.BlockSpec((block,), lambda i: (i,)), **kw)(x, y)


def _line_of(marker):
  return testing.line_of(__file__, marker)


# ------------------------------------------------------------------ debugging

def test_debug_print_uses_device_print(capsys):
  def kernel(x_ref, o_ref):
    pl.debug_print("pid={} v={}", pl.program_id(0), x_ref[0])
    o_ref[...] = x_ref[...]
  out = call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), jnp.arange(8.),
             grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
             out_specs=pl.BlockSpec((4,), lambda i: (i,)))
  assert_close(out, jnp.arange(8.))        # waits for the kernel's prints
  printed = capsys.readouterr().out
  assert re.search(r"pid=.*\b0\b", printed) and re.search(r"v=.*\b4\.", printed)
  (src,) = lowering_triton.to_source(lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)))(x), jnp.arange(8.))
  assert "tl.device_print('pid=', i)" in src


def _checked_kernel(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
  o_ref[...] = x_ref[...]


def _checked(x):
  return pl.pallas_call(_checked_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        backend="triton_interpret")(x)


def test_runtime_assert_becomes_device_assert(runtime_asserts):
  (src,) = lowering_triton.to_source(_checked, jnp.ones(8))
  assert "tl.device_assert(" in src and "x must be positive" in src
  assert_close(jax.jit(_checked)(jnp.ones(8)), jnp.ones(8))
  with pytest.raises(Exception, match="x must be positive"):
    jax.block_until_ready(jax.jit(_checked)(-jnp.ones(8)))


def test_checks_are_skipped_without_runtime_asserts():
  (src,) = lowering_triton.to_source(_checked, jnp.ones(8))
  assert "tl.device_assert" not in src
  assert_close(jax.jit(_checked)(-jnp.ones(8)), -jnp.ones(8))


# ------------------------------------------------------------------ errors

def test_unsupported_primitive_names_primitive_kernel_and_line():
  def odd_kernel(x_ref, o_ref):
    o_ref[...] = testing.no_rule_p.bind(x_ref[...])   # UNSUPPORTED-LINE
  x = jnp.zeros(8)
  with pytest.raises(pl.BackendError) as e:
    jax.jit(lambda x: pl.pallas_call(
        odd_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
        backend="triton_interpret")(x))(x)
  msg = str(e.value)
  assert "primitive 'no_rule_for_tests'" in msg
  assert "kernel 'odd_kernel'" in msg
  assert f"test_triton_errors.py:{_line_of('# UNSUPPORTED-LINE')}" in msg
  assert not isinstance(e.value, KeyError)


def test_verbose_error_marks_the_failing_equation(verbose_errors):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sort(x_ref[...])
  x = jnp.zeros(8)
  with pytest.raises(pl.BackendError) as e:
    lowering_triton.to_source(lambda x: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(x), x)
  msg = str(e.value)
  assert "primitive 'sort'" in msg and ">>>" in msg
  assert "sort" in msg.split(">>>")[1][:400]     # the marked equation


@pytest.mark.parametrize("case", ["cas_on_padded",
                                  "array_index", "semaphore", "too_large"])
def test_unsupported_constructs_raise_clear_errors(case):
  scratch = ()
  shape = jax.ShapeDtypeStruct((10,), jnp.int32)
  x = jnp.zeros((10,), jnp.int32)
  if case == "cas_on_padded":
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...]
      plt.atomic_cas(o_ref, x_ref[...], x_ref[...] + 1)
    match = "atomic_cas on a window that needs masking"
  elif case == "array_index":
    # (arrays of indices are blocks of pointers: test_index_arrays.py);
    # numpy moves the dims of ones a slice separates to the front
    shape = jax.ShapeDtypeStruct((5, 4), jnp.int32)
    x = jnp.zeros((5, 4, 3), jnp.int32)
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[jnp.arange(5), :, 0]
    match = "separated from the other integer indices by a slice"
  elif case == "semaphore":
    def kernel(x_ref, o_ref, sem):
      o_ref[...] = x_ref[...]
    scratch = [pltpu.SemaphoreType.DMA(())] if hasattr(
        pltpu, "SemaphoreType") else pytest.skip("no semaphores in dsl.tpu")
    match = "semaphore"
  elif case == "too_large":
    shape = jax.ShapeDtypeStruct((2048, 1024), jnp.float32)
    x = jnp.zeros((2048, 1024), jnp.float32)
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    match = "Triton's limit"
  with pytest.raises(pl.BackendError, match=match) as e:
    lowering_triton.to_source(lambda x: pl.pallas_call(
        kernel, shape, scratch_shapes=scratch)(x), x)
  assert "kernel 'kernel'" in str(e.value)


def test_scan_over_arrays_lowers_as_the_lowering_normalizes_it():
  """`to_source` shows what the lowering builds: a scan over arrays becomes
  a loop over a scoped buffer there (dsl.core.normalize), so it lowers."""
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.scan(lambda c, v: (c + v, c), 0, x_ref[...])[1]
  x = jnp.arange(10, dtype=jnp.int32)
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct((10,), jnp.int32),
                               backend="triton_interpret")(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "for " in src
  np.testing.assert_array_equal(f(x), jnp.cumsum(x) - x)


def test_float32_dot_precision_follows_jax_config():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...])
  a = jnp.ones((16, 16))
  f = lambda a: pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 16),
                                                            jnp.float32))(a, a)
  (src,) = lowering_triton.to_source(f, a)
  assert 'input_precision="tf32"' in src
  with jax.default_matmul_precision("float32"):
    (src,) = lowering_triton.to_source(f, a)
  assert 'input_precision="ieee"' in src


def test_debug_flag_prints_the_generated_source(capsys):
  x = jnp.arange(256.)
  jax.jit(lambda x: blocked_add(x, x, backend="triton_interpret",
                                debug=True))(x)
  out = capsys.readouterr().out
  assert "--- Triton source of kernel add_kernel" in out
  assert "def add_kernel(x_ptr, y_ptr, o_ptr):" in out


def _shifted_copy_kernel(x_ref, o_ref):
  y = x_ref[...] * 2.0
  o_ref[...] = y


def test_values_take_names_from_assignments_not_keywords():
  # The index maps' arithmetic sits on the `in_specs=` / `out_specs=` lines;
  # those are keyword arguments, not variables, so no value is named after
  # them. The kernel's own `y = ...` names its value.
  x = jnp.ones((512,))

  def f(x):
    return pl.pallas_call(
        _shifted_copy_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
        in_specs=[pl.BlockSpec((128,), lambda i: (i * 2 + 1,))],
        out_specs=pl.BlockSpec((128,), lambda i: (i + 1,)), backend="triton")(x)
  (src,) = lowering_triton.to_source(f, x)
  assigned = re.findall(r"^\s+(\w+) = ", src, re.M)
  assert "in_specs" not in assigned and "out_specs" not in assigned, src
  assert "y" in assigned, src
  assert re.search(r"x_start = \w+ \* 128", src), src


def test_reshapes_that_only_add_unit_dims_index_with_none():
  """`jnp.reshape(row_sums, (n, 1))` (what reverse mode makes of a reduction
  with keepdims) is `x[:, None]`, not `tl.reshape`: Triton lays a reshaped
  row vector out whole in every thread, and a tile broadcast from it kept
  that layout (the softmax backward never finished compiling)."""
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    s = jnp.sum(x, axis=1).reshape(x.shape[0], 1)      # (64,) -> (64, 1)
    c = jnp.sum(x, axis=0).reshape(1, 1, x.shape[1])   # (256,) -> (1, 1, 256)
    o_ref[...] = x * s + c[0]
  x = array(5, (128, 256), jnp.float32)
  f = lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((64, 256), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((64, 256), lambda i: (i, 0)),
      backend="triton_interpret")(x)
  (src,) = lowering_triton.to_source(f, x)
  assert not re.search(r"tl.reshape\(sum_", src)
  assert re.search(r"= sum_\w*\[:, None\]", src)
  assert re.search(r"= sum_\w*\[None, None, :\]", src)
  blocks = x.reshape(2, 64, 256)
  want = (blocks * blocks.sum(2, keepdims=True)
          + blocks.sum(1, keepdims=True)).reshape(x.shape)
  assert_close(jax.jit(f)(x), want)


def test_fori_loops_with_run_time_bounds_become_for_loops():
  """`fori_loop` with bounds from the program id is a `while` in the jaxpr;
  it lowers to `for j in tl.range(lo, hi)` (Triton pipelines for loops, not
  while loops), its window loads unmasked where the range analysis bounds
  the counter; a loop that does not count up by one stays a `while`."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    acc = lax.fori_loop(i, 2 * i + 1,
                        lambda j, acc: acc + x_ref[pl.ds(j * 8, 8), :],
                        jnp.zeros((8, 128), jnp.float32))
    halve = lax.while_loop(lambda c: c[0] > 1, lambda c: (c[0] // 2, c[1] + 1),
                           (i + 7, 0))[1]
    o_ref[...] = acc + halve.astype(jnp.float32)
  x = array(8, (64, 128), jnp.float32)
  f = lambda x, backend="triton_interpret": pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((64, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)(x)
  (src,) = lowering_triton.to_source(f, x)
  assert re.search(r"for j in tl\.range\(i, \w+\):", src)
  assert src.count("while ") == 1
  assert "mask=" not in src
  assert_close(jax.jit(f)(x), jax.jit(lambda x: f(x, "interpret"))(x))


def test_broadcast_arrays_of_indices_lower_on_triton():
  """`x_ref.at[rows[:, None], cols[None]]` (Pallas's GPU layer norm backward):
  JAX broadcasts the two arrays of indices (its `broadcast_to` primitive,
  which dsl rewrites into lax ops every lowering has), and the Triton
  backend takes both arrays."""
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)

  def kernel(x_ref, o_ref):
    rows, cols = jnp.arange(8)[::-1], jnp.arange(16)
    o_ref[...] = x_ref.at[rows[:, None], cols[None]][...] * 2
  for backend in ("interpret", "triton_interpret"):
    got = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         backend=backend)(x)
    np.testing.assert_array_equal(got, 2 * x[::-1], err_msg=backend)
