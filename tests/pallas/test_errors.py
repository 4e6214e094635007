"""Bad input gets a clear error at trace time naming kernel, operand and line."""
import re

import jax
import jax.numpy as jnp
import pytest

import dsl as pl

THIS_FILE = __file__


def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


SDS = jax.ShapeDtypeStruct((16,), jnp.float32)
X = jnp.ones(16)


def spec(block=(8,), index_map=lambda i: (i,)):
  return pl.BlockSpec(block, index_map)


def _call(kernel=copy_kernel, out_shape=SDS, args=(X,), **kw):
  kw.setdefault("grid", (2,))
  kw.setdefault("in_specs", [spec()] * len(args))
  kw.setdefault("out_specs", spec())
  return pl.pallas_call(kernel, out_shape, **kw)(*args)


def _raises(match, fn, exc=pl.KernelError):
  with pytest.raises(exc) as info:
    fn()
  msg = str(info.value)
  assert re.search(match, msg), msg
  return msg


def _points_here(msg):
  assert THIS_FILE in msg, msg


def test_wrong_number_of_in_specs():
  msg = _raises(r"kernel 'add_kernel', in_specs: in_specs has 1 BlockSpecs but "
                r"there are 2 inputs",
                lambda: _call(add_kernel, args=(X, X), in_specs=[spec()]))
  _points_here(msg)


def test_index_map_arity():
  msg = _raises(r"in_specs\[0\]: index_map takes 2 arguments but the grid has "
                r"rank 1",
                lambda: _call(in_specs=[spec(index_map=lambda i, j: (i,))]))
  _points_here(msg)


def test_index_map_wrong_count():
  _raises(r"out_specs\[0\]: index_map returns 2 indices but the block has rank 1",
          lambda: _call(out_specs=spec(index_map=lambda i: (i, 0))))


def test_index_map_non_integer():
  _raises(r"in_specs\[0\]: index_map result 0 must be an integer scalar, got "
          r"f32\[\]", lambda: _call(in_specs=[spec(index_map=lambda i: (i * 1.5,))]),
          TypeError)


def test_block_rank_mismatch():
  msg = _raises(r"in_specs\[0\]: block shape \(8, 1\) has rank 2 but the array "
                r"has shape \(16,\)",
                lambda: _call(in_specs=[spec(block=(8, 1),
                                             index_map=lambda i: (i, 0))]))
  _points_here(msg)


def test_block_larger_than_array():
  _raises(r"in_specs\[0\]: block dim 0 is 32 but the array dim is only 16",
          lambda: _call(in_specs=[spec(block=(32,))]))


def test_out_shape_and_out_specs_count():
  _raises(r"out_specs: out_specs has 2 BlockSpecs but there are 1 outputs",
          lambda: _call(out_specs=[spec(), spec()]))


def test_kernel_arity():
  msg = _raises(r"the kernel takes 2 refs but pallas_call passes 3: 0 scalar "
                r"prefetch \+ 2 inputs \+ 1 outputs \+ 0 scratch",
                lambda: _call(copy_kernel, args=(X, X)))
  assert "kernel defined at" in msg and THIS_FILE in msg


def test_store_wrong_shape_names_operand_and_line():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...][:4]
  msg = _raises(r"kernel 'kernel', o_ref \(out_specs\[0\]\): .*shape",
                lambda: _call(kernel))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


def test_store_wrong_dtype():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(jnp.int32)
  _raises(r"o_ref \(out_specs\[0\]\): .*dtype", lambda: _call(kernel))


def test_static_index_outside_block():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[0:16]
  msg = _raises(r"x_ref \(in_specs\[0\]\): slice 0:16 on dim 0 is outside the "
                r"ref's shape \(8,\)", lambda: _call(kernel))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


def test_static_int_index_outside_block():
  def kernel(x_ref, o_ref):
    o_ref[0] = x_ref[9]
  _raises(r"x_ref \(in_specs\[0\]\): index 9 on dim 0 is outside",
          lambda: _call(kernel))


def test_ds_outside_block():
  def kernel(x_ref, o_ref):
    o_ref[pl.ds(4, 8)] = x_ref[...]
  _raises(r"o_ref \(out_specs\[0\]\): pl.ds\(4, 8\) on dim 0 is outside",
          lambda: _call(kernel))


@pytest.mark.parametrize("grid,match", [
    ((0,), r"grid\[0\] must be a positive integer, got 0"),
    ((-2,), r"grid\[0\] must be a positive integer, got -2"),
    ((2.0,), r"grid\[0\] must be a positive integer, got 2.0"),
])
def test_grid_not_positive_integers(grid, match):
  _raises(match, lambda: _call(grid=grid))


def test_traced_grid_size_rejected():
  def f(n):
    return _call(grid=(n,))
  _raises(r"grid\[0\] must be a positive integer.*traced grid sizes",
          lambda: jax.jit(f)(2))


def test_alias_shape_mismatch():
  _raises(r"input_output_aliases: input 0 \(f32\[16\]\) is aliased to output 0 "
          r"\(f32\[8\]\)",
          lambda: _call(out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                        out_specs=spec(), grid=(1,), input_output_aliases={0: 0}))


def test_kernel_returning_value():
  def kernel(x_ref, o_ref):
    return x_ref[...]
  _raises(r"returns None, but it returned", lambda: _call(kernel))


def test_program_id_outside_kernel():
  _raises(r"program_id can only be called inside a kernel body",
          lambda: pl.program_id(0))


def test_program_id_axis_out_of_grid():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * pl.program_id(1)
  _raises(r"program_id\(1\) is outside the grid of rank 1", lambda: _call(kernel))


def test_unknown_backend():
  _raises(r"unknown backend 'cuda'", lambda: _call(backend="cuda"),
          pl.BackendError)


def test_user_exception_in_kernel_is_wrapped_with_line():
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], jnp.ones((3, 3)))
  msg = _raises(r"kernel 'kernel'.*TypeError", lambda: _call(kernel))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


def test_bad_spec_type():
  _raises(r"in_specs\[0\]: expected a BlockSpec", lambda: _call(in_specs=[(8,)]),
          TypeError)
