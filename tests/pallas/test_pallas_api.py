"""Pallas API names a kernel written for jax.experimental.pallas uses:
each runs on dsl by changing the import, checked against jnp and against
Pallas in interpret mode on the same kernel source."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl
from dsl import tpu as dtpu
from tests.pallas import mosaic_golden
from tests.pallas.testing import assert_close

TPU = {dsl: dtpu, jpl: jpltpu}


def buffered_add(pl, n_buffers, x, y):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0),
                      pipeline_mode=pl.Buffered(n_buffers))
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
      in_specs=[spec, pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), interpret=True)(x, y)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_buffered_runs_like_pallas(n):
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  y = jnp.ones_like(x)
  ours = buffered_add(dsl, n, x, y)
  assert_close(ours, x + y)
  assert_close(ours, buffered_add(jpl, n, x, y))


def _mosaic_calls(pl, n):
  x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  extra = {"backend": "mosaic"} if pl is dsl else {}
  f = pl.pallas_call(
      kernel, x, grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0),
                             pipeline_mode=pl.Buffered(n))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), **extra)
  return mosaic_golden.lower_tpu(f, x)


@pytest.mark.parametrize("n", [1, 2])
def test_buffered_mosaic_window_matches_pallas(n):
  ours, theirs = _mosaic_calls(dsl, n), _mosaic_calls(jpl, n)
  kind = "synchronous" if n == 1 else "double_buffered"
  assert f"#tpu.pipeline_mode<{kind}>" in ours[0].module
  assert mosaic_golden.compare(ours, theirs, [__file__]) == []


def _buffered_add_on(backend, n, x, y):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  spec = dsl.BlockSpec((8, 128), lambda i: (i, 0),
                       pipeline_mode=dsl.Buffered(n))
  return dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
      in_specs=[spec, spec], out_specs=dsl.BlockSpec((8, 128), lambda i: (i, 0)),
      backend=backend)(x, y)


def test_buffered_three_runs_on_the_host_backend():
  # the count is a hint there: blocks run one at a time
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  y = jnp.full_like(x, 3.0)
  assert_close(_buffered_add_on("interpret", 3, x, y), x + y)


def test_buffered_is_refused_by_triton_as_by_pallas():
  # each Triton program loads its block once: no pipeline to set
  x = jnp.ones((32, 128), jnp.float32)
  with pytest.raises(dsl.BackendError, match="in_specs\\[0\\].*pipeline_mode"):
    _buffered_add_on("triton_interpret", 3, x, x)


def test_buffered_three_rejected_by_mosaic_interpret():
  # as by Pallas's TPU lowering (test_mosaic_golden.REJECTED_BY_BOTH)
  x = jnp.ones((32, 128), jnp.float32)
  with pytest.raises(dsl.BackendError, match="Buffered\\(3\\)"):
    _buffered_add_on("mosaic_interpret", 3, x, x)


def test_bad_pipeline_mode_is_type_error():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  f = dsl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                      in_specs=[dsl.BlockSpec((8,), lambda: (0,),
                                              pipeline_mode="double")],
                      interpret=True)
  with pytest.raises(TypeError, match="pipeline_mode"):
    f(jnp.ones(8))


def sync_copy_kernel(pl, x):
  pltpu = TPU[pl]
  def kernel(x_ref, o_ref, buf):
    pltpu.sync_copy(x_ref, buf)
    buf[...] = buf[...] + 1
    pltpu.sync_copy(buf, o_ref)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)], interpret=True)(x)


def test_sync_copy_like_pallas():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  ours = sync_copy_kernel(dsl, x)
  assert_close(ours, x + 1)
  assert_close(ours, sync_copy_kernel(jpl, x))


def test_sync_copy_pytree():
  def kernel(a_ref, b_ref, oa_ref, ob_ref):
    dtpu.sync_copy((a_ref, b_ref), (oa_ref, ob_ref))
  a, b = jnp.arange(8.), jnp.arange(16.) * 2
  oa, ob = dsl.pallas_call(
      kernel, (jax.ShapeDtypeStruct(a.shape, a.dtype),
               jax.ShapeDtypeStruct(b.shape, b.dtype)),
      in_specs=[dsl.BlockSpec(memory_space=dsl.ANY)] * 2,
      out_specs=[dsl.BlockSpec(memory_space=dsl.ANY)] * 2,
      interpret=True)(a, b)
  assert_close(oa, a)
  assert_close(ob, b)


def list_out_kernel(pl, x):
  def kernel(x_ref, a_ref, b_ref):
    a_ref[...] = x_ref[...] + 1
    b_ref[...] = x_ref[...] * 2
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return pl.pallas_call(kernel, [shape, shape], interpret=True)(x)


def test_out_shape_list_like_pallas():
  x = jnp.arange(16.)
  ours, theirs = list_out_kernel(dsl, x), list_out_kernel(jpl, x)
  assert type(ours) is type(theirs) is tuple
  assert_close(ours[0], x + 1)
  assert_close(ours[1], x * 2)
  for a, b in zip(ours, theirs):
    assert_close(a, b)


def test_masked_tpu_load_store_and_reciprocal():
  def kernel(x_ref, o_ref):
    x = dtpu.load(x_ref)
    dtpu.store(o_ref, dtpu.reciprocal(x, approx=True),
               mask=jnp.arange(8) < 5)
  x = jnp.arange(1., 9.)
  out = dsl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                        input_output_aliases={0: 0}, interpret=True)(x)
  want = jnp.where(jnp.arange(8) < 5, 1 / x, x)
  assert_close(out, want)


def test_helpers_match_pallas():
  for v in [0, 1, 3, 8, 9, 1000]:
    assert dsl.next_power_of_2(v) == jpl.next_power_of_2(v)
    assert dsl.align_to(v, 8) == jpl.align_to(v, 8)
  assert dsl.strides_from_shape((2, 3, 4)) == jpl.strides_from_shape((2, 3, 4))
  assert isinstance(dtpu.CompilerParams(), dsl.CompilerParams)
  assert isinstance(dsl.triton.CompilerParams(), dsl.CompilerParams)
  assert dsl.DeviceIdType.LOGICAL is dtpu.DeviceIdType.LOGICAL
  with dsl.enable_debug_checks(True):
    from dsl.core import config
    assert config.enable_debug_checks()


def _copy(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _two_in(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...]


def _bad_matmul(x_ref, o_ref):
  o_ref[...] = x_ref[...] @ jnp.ones((3, 3))


_S = jax.ShapeDtypeStruct((16, 128), jnp.float32)
_ROWS = lambda pl: pl.BlockSpec((8, 128), lambda i: (i, 0))
BAD_CALLS = {
    "block rank": lambda pl: pl.pallas_call(
        _copy, _S, grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
        out_specs=_ROWS(pl), interpret=True),
    "index_map arity": lambda pl: pl.pallas_call(
        _copy, _S, grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, 0))],
        out_specs=_ROWS(pl), interpret=True),
    "index_map results": lambda pl: pl.pallas_call(
        _copy, _S, grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i,))],
        out_specs=_ROWS(pl), interpret=True),
    "spec count": lambda pl: pl.pallas_call(
        _copy, _S, grid=(2,), in_specs=[_ROWS(pl)] * 2, out_specs=_ROWS(pl),
        interpret=True),
    "alias shape": lambda pl: pl.pallas_call(
        _copy, jax.ShapeDtypeStruct((8,), jnp.float32),
        input_output_aliases={0: 0}, interpret=True),
    "alias index": lambda pl: pl.pallas_call(
        _copy, _S, input_output_aliases={3: 0}, interpret=True),
    "kernel arity": lambda pl: pl.pallas_call(_two_in, _S, interpret=True),
    "kernel body": lambda pl: pl.pallas_call(_bad_matmul, _S, interpret=True),
    "zero block": lambda pl: pl.pallas_call(
        _copy, _S, grid=(2,), in_specs=[pl.BlockSpec((0, 128), lambda i: (i, 0))],
        out_specs=_ROWS(pl), interpret=True),
}


def _raised(make, pl):
  with pytest.raises(Exception) as info:
    make(pl)(jnp.ones((16, 128)))
  return info.value


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_errors_are_of_pallas_class(case):
  """Code that catches Pallas's exception class catches ours."""
  theirs = _raised(BAD_CALLS[case], jpl)
  ours = _raised(BAD_CALLS[case], dsl)
  assert isinstance(ours, dsl.KernelError)
  for cls in (ValueError, TypeError):
    if isinstance(theirs, cls):
      assert isinstance(ours, cls), (case, type(theirs), type(ours))


def big_block_kernel(pl, x, block, **kw):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1
  spec = pl.BlockSpec(block, lambda i: (0,) * len(block))
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(1,), in_specs=[spec], out_specs=spec, **kw)


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_block_larger_than_array_is_padded(backend):
  x = jnp.arange(10, dtype=jnp.float32)
  ours = big_block_kernel(dsl, x, (16,), backend=backend)(x)
  assert_close(ours, x * 2 + 1)
  assert_close(ours, big_block_kernel(jpl, x, (16,), interpret=True)(x))


def test_block_larger_than_array_mosaic():
  x = jnp.arange(600, dtype=jnp.float32).reshape(6, 100)
  ours = big_block_kernel(dsl, x, (8, 128), backend="mosaic_interpret")(x)
  assert_close(ours, x * 2 + 1)
  lowered = mosaic_golden.lower_tpu(
      big_block_kernel(dsl, x, (8, 128), backend="mosaic"), x)
  theirs = mosaic_golden.lower_tpu(big_block_kernel(jpl, x, (8, 128)), x)
  assert mosaic_golden.compare(lowered, theirs, [__file__]) == []


_CONST = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
_TABLE = jnp.array([1, 0], jnp.int32)


def _const_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] + _CONST


def _const_call(backend, index_map):
  return dsl.pallas_call(
      _const_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
      in_specs=[dsl.BlockSpec((8, 128), index_map)],
      out_specs=dsl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret",
                                     "triton_interpret"])
def test_kernel_closing_over_an_array(backend):
  # Pallas 0.11 rejects this with ValueError; dsl runs it.
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  out = jax.jit(_const_call(backend, lambda i: (i, 0)))(x)
  assert_close(out, x + jnp.tile(_CONST, (2, 1)))


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_index_map_closing_over_an_array(backend):
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  out = _const_call(backend, lambda i: (_TABLE[i], 0))(x)
  want = jnp.concatenate([x[8:], x[:8]]) + jnp.tile(_CONST, (2, 1))
  assert_close(out, want)


def _axpy(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] * 2 + y_ref[...]


def _axpy_call(pl, x, y, aliases=None):
  spec = pl.BlockSpec((8,), lambda i: (i,))
  return pl.pallas_call(_axpy, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(2,), in_specs=[spec, spec], out_specs=spec,
                        input_output_aliases=aliases or {},
                        interpret=True)(x, y)


VMAPS = {
    "in_axes None": lambda pl, xs, y: jax.vmap(
        lambda x, y: _axpy_call(pl, x, y), in_axes=(0, None))(xs, y),
    "constant argument": lambda pl, xs, y: jax.vmap(
        lambda x: _axpy_call(pl, x, jnp.full((16,), 3.)))(xs),
    "alias of the unbatched operand": lambda pl, xs, y: jax.vmap(
        lambda x, y: _axpy_call(pl, x, y, {1: 0}), in_axes=(0, None))(xs, y),
    "alias of the batched operand": lambda pl, xs, y: jax.vmap(
        lambda y, x: _axpy_call(pl, x, y, {1: 0}), in_axes=(0, None))(xs, y),
}


@pytest.mark.parametrize("case", sorted(VMAPS))
def test_vmap_like_pallas(case):
  xs, y = jnp.arange(48.).reshape(3, 16), jnp.linspace(0, 1, 16)
  ours = VMAPS[case](dsl, xs, y)
  theirs = VMAPS[case](jpl, xs, y)
  assert_close(ours, theirs)
  assert ours.shape == (3, 16)


def _named_grid_call(pl, x):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)
  spec = pl.BlockSpec((8,), lambda i: (i,))
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(("i", 4),), in_specs=[spec], out_specs=spec,
                        interpret=True)(x)


def test_named_grid_like_pallas():
  x = jnp.arange(32.)
  ours = _named_grid_call(dsl, x)
  assert_close(ours, x + jnp.repeat(jnp.arange(4.), 8))
  assert_close(ours, _named_grid_call(jpl, x))


def test_empty_and_no_block_spec():
  def kernel(x_ref, o_ref):
    scratch = dsl.empty(x_ref.shape, x_ref.dtype)   # every element rewritten
    o_ref[...] = jnp.zeros_like(scratch) + x_ref[...] * 2
  x = jnp.arange(8.)
  for pl in (dsl, jpl):
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         in_specs=pl.no_block_spec, out_specs=pl.no_block_spec,
                         interpret=True)(x)
    assert_close(out, x * 2)
  tree = dsl.empty_like({"a": jax.ShapeDtypeStruct((2, 3), jnp.int8)})
  assert tree["a"].shape == (2, 3) and tree["a"].dtype == jnp.int8
  assert not dtpu.is_tpu_device() and not jpltpu.is_tpu_device()


def test_tpu_compiler_params_take_every_pallas_field():
  import dataclasses
  theirs = {f.name for f in dataclasses.fields(jpltpu.CompilerParams)}
  ours = {f.name for f in dataclasses.fields(dtpu.CompilerParams)}
  assert theirs <= ours, sorted(theirs - ours)
  params = dtpu.CompilerParams(dimension_semantics=("parallel",),
                               needs_layout_passes=True, serialization_format=1)
  assert isinstance(params, dsl.CompilerParams)
  assert issubclass(dtpu.LoweringException, Exception)
  with pytest.raises(dtpu.LoweringException):
    _mosaic_calls(dsl, 3)
