"""Bad input gets a clear error at trace time naming kernel, operand and line."""
import re

import jax
import jax.numpy as jnp
import numpy as np
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
  msg = _raises(r"kernel 'add_kernel', in_specs: Pytree for `in_specs` and "
                r"`inputs` do not match\. There are 1 mismatches, including: "
                r"`in_specs` is a tuple of length 1 but `inputs` is a tuple of "
                r"length 2.*\(in_specs has 1 BlockSpecs but there are 2 "
                r"inputs\)",
                lambda: _call(add_kernel, args=(X, X), in_specs=[spec()]))
  _points_here(msg)


def test_index_map_arity():
  msg = _raises(r"in_specs\[0\]: index_map <lambda>\(\) missing 1 required "
                r"positional argument: 'j': the grid has rank 1",
                lambda: _call(in_specs=[spec(index_map=lambda i, j: (i,))]))
  _points_here(msg)


def test_index_map_wrong_count():
  _raises(r"out_specs\[0\]: Index map function <lambda> at .*test_errors.py:"
          r"\d+ for outputs must return 1 values to match the block shape "
          r"\(8,\)\. Currently returning 2 values",
          lambda: _call(out_specs=spec(index_map=lambda i: (i, 0))))


def test_index_map_non_integer():
  _raises(r"in_specs\[0\]: Index map function <lambda> at .*test_errors.py:"
          r"\d+ for args\[0\] must return integer scalars\. Output\[0\] has "
          r"type float32\[\]", lambda: _call(in_specs=[spec(index_map=lambda i: (i * 1.5,))]),
          TypeError)


def test_block_rank_mismatch():
  msg = _raises(r"in_specs\[0\]: Block shape for args\[0\] \(= \(8, 1\)\) must "
                r"have the same number of dimensions as the array shape "
                r"\(16,\): rank 2 vs 1",
                lambda: _call(in_specs=[spec(block=(8, 1),
                                             index_map=lambda i: (i, 0))]))
  _points_here(msg)


def test_out_shape_and_out_specs_count():
  _raises(r"out_specs: Pytree for `out_specs` and `out_shape` do not match\. "
          r".*\(out_specs has 2 BlockSpecs but there are 1 outputs",
          lambda: _call(out_specs=[spec(), spec()]))


def test_kernel_arity():
  msg = _raises(r"copy_kernel\(\) takes 2 positional arguments but 3 were "
                r"given: pallas_call passes 0 scalar prefetch \+ 2 inputs \+ 1 "
                r"outputs \+ 0 scratch refs",
                lambda: _call(copy_kernel, args=(X, X)))
  assert "kernel defined at" in msg and THIS_FILE in msg


def _optional_outputs_kernel(x_ref, o_ref, mean_ref=None, rstd_ref=None):
  o_ref[...] = x_ref[...] * 2
  if mean_ref is not None:
    mean_ref[...] = jnp.sum(x_ref[...], axis=1)
    rstd_ref[...] = jnp.max(x_ref[...], axis=1)


def test_kernel_parameters_with_defaults_take_fewer_or_more_refs():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  o = pl.pallas_call(_optional_outputs_kernel,
                     out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  np.testing.assert_array_equal(o, x * 2)
  row = jax.ShapeDtypeStruct((8,), x.dtype)
  o, mean, rstd = pl.pallas_call(
      _optional_outputs_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), row, row])(x)
  np.testing.assert_array_equal(mean, jnp.sum(x, axis=1))
  np.testing.assert_array_equal(rstd, jnp.max(x, axis=1))
  _raises(r"_optional_outputs_kernel\(\) takes from 2 to 4 positional "
          r"arguments but 5 were given",
          lambda: pl.pallas_call(_optional_outputs_kernel,
                                 out_shape=[jax.ShapeDtypeStruct(x.shape,
                                                                 x.dtype)] * 4
                                 )(x))


def test_store_wrong_shape_names_operand_and_line():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...][:4]
  msg = _raises(r"kernel 'kernel', o_ref \(out_specs\[0\]\): .*shape",
                lambda: _call(kernel))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


def test_store_wrong_dtype():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(jnp.int32)
  msg = _raises(r"kernel 'kernel', o_ref \(out_specs\[0\]\): storing int32 "
                r"values into o_ref, a float32 ref: cast it first with "
                r"`\.astype\(o_ref\.dtype\)`", lambda: _call(kernel))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


@pytest.mark.parametrize("body", ["x_ref + 1", "1 + x_ref", "x_ref.sum()",
                                  "jnp.exp(x_ref)"])
def test_ref_used_as_value(body, tmp_path):
  import importlib.util
  path = tmp_path / "user_kernel.py"
  path.write_text("import jax.numpy as jnp\n\ndef kernel(x_ref, o_ref):\n"
                  f"  o_ref[...] = {body}\n")
  spec_ = importlib.util.spec_from_file_location("user_kernel", path)
  module = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(module)
  msg = _raises(r"kernel 'kernel', x_ref \(in_specs\[0\]\): x_ref is a ref, "
                r"not a value: read it with `x_ref\[\.\.\.\]`",
                lambda: _call(module.kernel))
  assert f"{path}:4" in msg


def test_ref_used_as_value_names_the_right_ref():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + o_ref
  _raises(r"o_ref \(out_specs\[0\]\): o_ref is a ref, not a value: read it "
          r"with `o_ref\[\.\.\.\]`", lambda: _call(kernel))


def test_forgotten_out_specs_shows_the_blockspec_that_fits():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  msg = _raises(
      r"kernel 'kernel', o_ref \(out_specs\[0\]\): the value stored has shape "
      r"\(8,\), but o_ref is the whole array \(16,\): out_specs\[0\] has no "
      r"BlockSpec \(no `out_specs` means the whole array\)\. A BlockSpec that "
      r"fits the value: out_specs\[0\] = pl\.BlockSpec\(\(8,\), lambda i: "
      r"\(i,\)\)", lambda: _call(kernel, out_specs=None))
  assert f"{THIS_FILE}:{kernel.__code__.co_firstlineno + 1}" in msg


def test_forgotten_out_specs_2d_grid():
  x = jnp.ones((16, 32))
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  _raises(r"out_specs\[0\] = pl\.BlockSpec\(\(8, 32\), lambda i, j: \(i, 0\)\)",
          lambda: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 grid=(2, 1),
                                 in_specs=[pl.BlockSpec((8, 32), lambda i, j: (i, 0))])(x))


def test_forgotten_in_specs_shows_the_blockspec_that_fits():
  _raises(r"x_ref \(in_specs\[0\]\): the value stored into o_ref has shape "
          r"\(16,\), the whole array of x_ref: in_specs\[0\] has no BlockSpec "
          r"\(no `in_specs` means the whole array\)\. A BlockSpec that gives "
          r"x_ref blocks of \(8,\): in_specs\[0\] = pl\.BlockSpec\(\(8,\), "
          r"lambda i: \(i,\)\)", lambda: _call(in_specs=None))


def _scale(x_ref, o_ref, *, factor):
  o_ref[...] = x_ref[...] * factor


def test_partial_kernel_reports_the_wrapped_name():
  import functools
  bad = functools.partial(_scale, factor=jnp.ones(3))
  msg = _raises(r"kernel '_scale'", lambda: _call(bad))
  assert "kernel 'partial'" not in msg and "kernel 'kernel'" not in msg
  good = pl.pallas_call(functools.partial(_scale, factor=2.0), SDS)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x: good(x).sum()))(X)
  names = [e.params["spec"].name for e in jaxpr.eqns
           if e.primitive is pl.pallas_call_p]
  assert names == ["_scale", "_scale_transpose"], names
  srcs = {e.params["spec"].kernel_src for e in jaxpr.eqns
          if e.primitive is pl.pallas_call_p}
  assert srcs == {f"{THIS_FILE}:{_scale.__code__.co_firstlineno}"}, srcs


def test_spec_error_points_at_the_blockspec_line():
  bad = pl.BlockSpec((8, 1), lambda i: (i, 0)); line = _line()
  msg = _raises(r"in_specs\[0\]: Block shape for args\[0\] \(= \(8, 1\)\)",
                lambda: _call(in_specs=[bad]))
  assert f"{THIS_FILE}:{line}; the pallas_call at {THIS_FILE}:" in msg, msg


def _line():
  import sys
  return sys._getframe(1).f_lineno


def test_traceback_shows_the_users_frames_only():
  import traceback
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref + 1
  with pytest.raises(pl.KernelError) as info:
    _call(kernel)
  err = info.value
  frames = traceback.extract_tb(err.__traceback__)
  assert {f.filename for f in frames} == {THIS_FILE}, frames
  assert frames[-1].lineno == kernel.__code__.co_firstlineno + 1
  assert err.__cause__ is None and err.__suppress_context__
  assert isinstance(err.original_error, AttributeError)


def test_printed_traceback_is_short(tmp_path):
  import os, subprocess, sys
  script = tmp_path / "user.py"
  script.write_text(
      "import jax.numpy as jnp\nimport dsl as pl\n"
      "def kernel(x_ref, o_ref):\n  o_ref[...] = x_ref + 1\n"
      "x = jnp.ones(8)\npl.pallas_call(kernel, x)(x)\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  env.pop("JAX_TRACEBACK_FILTERING", None)
  out = subprocess.run([sys.executable, str(script)], env=env, text=True,
                       capture_output=True, timeout=120).stderr
  lines = out.strip().splitlines()
  assert lines[0] == "Traceback (most recent call last):", out
  files = [l for l in lines if l.lstrip().startswith("File ")]
  assert len(files) == 2 and all(str(script) in f for f in files), out
  assert "direct cause" not in out and "During handling" not in out, out
  first = next(l for l in lines if l.startswith("dsl.core.errors.KernelError"))
  assert first == (f"dsl.core.errors.KernelError: kernel 'kernel', x_ref "
                   f"(in_specs[0]): x_ref is a ref, not a value: read it with "
                   f"`x_ref[...]` (AttributeError: 'AbstractRef' object has no "
                   f"attribute '_add') (at {script}:4)"), out


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
    ((2.0,), r"grid\[0\] must be a positive integer or a traced integer "
             r"scalar, got 2.0"),
])
def test_grid_not_positive_integers(grid, match):
  _raises(match, lambda: _call(grid=grid))


def test_alias_shape_mismatch():
  _raises(r"input_output_aliases: input_output_aliases contains the mapping "
          r"'0:0' referring to input\[0\] with abstract value float32\[16\] "
          r"and to output\[0\] with a different abstract value float32\[8\]",
          lambda: _call(out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                        out_specs=spec(), grid=(1,), input_output_aliases={0: 0}))


def test_kernel_returning_value():
  def kernel(x_ref, o_ref):
    return x_ref[...]
  _raises(r"The kernel function in the pallas_call kernel at "
          r".*test_errors.py:\d+ should return None \(it writes its results "
          r"to its output refs\), but it returned", lambda: _call(kernel))


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


def test_python_if_on_a_traced_value_is_not_a_ref_used_as_a_value():
  # A Python `if` on a traced value gets its own fix (pl.when, lax.cond,
  # jnp.where) with JAX's own words, not the hint about refs.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] if x_ref[0] > 0 else -x_ref[...]
  msg = _raises(r"kernel 'kernel': a Python `if`.*pl\.when.*Attempted "
                r"boolean conversion", lambda: _call(kernel), TypeError)
  assert "is a ref, not a value" not in msg
