"""Every elementwise and reduction operation, on every dtype it takes, on
every backend: one table.

Whether a backend lowers an operation is read from the registry, not
listed here: the operation's jaxpr is normalized as that backend's lowering
normalizes it (decompositions and fallbacks, dsl.core.normalize), and the
backend lowers it when its rule table has a rule for every primitive left.
Then the kernel `o = op(x)` must agree with jax.numpy on the CPU backends
(and build its module on Mosaic GPU); where a primitive has no rule, the
backend must refuse it with a `BackendError` naming the primitive. A rule
that takes a primitive but not a dtype must refuse that dtype the same way,
naming it (on Mosaic GPU, jaxlib's library refuses some dtypes and layouts
itself: a `BackendError` naming the kernel). The default suite runs float32, int32 and bool; `-m slow` adds
the narrow dtypes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl.core import backends, fallbacks
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, sub_jaxprs
from dsl.core.normalize import normalize_closed
from tests.pallas import testing
from tests.pallas.mosaic_gpu_testing import gpu_module

# 64 rows: Mosaic GPU reduces tiles of whole warpgroup row blocks
SHAPE = (64, 128)
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
INTS = (jnp.int32, jnp.int8, jnp.uint8)
BOOLS = (jnp.bool_,)
DEFAULT_DTYPES = {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32),
                  jnp.dtype(jnp.bool_)}
BACKENDS = ("triton_interpret", "mosaic_interpret", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Op:
  fn: Callable
  dtypes: tuple
  arity: int = 1
  # inputs: "any" (normal floats / ints in [-50, 50)), "positive",
  # "unit" (-1, 1), "small" (ints in [0, 8): shift amounts)
  domain: str = "any"
  tol: float | None = None      # float32 tolerance beyond the default


_pos = "positive"
OPS: dict[str, Op] = {
    # float math
    "exp": Op(jnp.exp, FLOATS), "exp2": Op(jnp.exp2, FLOATS),
    "expm1": Op(jnp.expm1, FLOATS), "log": Op(jnp.log, FLOATS, domain=_pos),
    "log1p": Op(jnp.log1p, FLOATS, domain=_pos),
    "log2": Op(jnp.log2, FLOATS, domain=_pos),
    "sqrt": Op(jnp.sqrt, FLOATS, domain=_pos),
    "rsqrt": Op(lax.rsqrt, FLOATS, domain=_pos),
    "cbrt": Op(jnp.cbrt, FLOATS), "tanh": Op(jnp.tanh, FLOATS),
    "logistic": Op(jax.nn.sigmoid, FLOATS), "sin": Op(jnp.sin, FLOATS),
    "cos": Op(jnp.cos, FLOATS), "tan": Op(jnp.tan, FLOATS, domain="unit"),
    "atan": Op(jnp.arctan, FLOATS), "sinh": Op(jnp.sinh, FLOATS),
    "cosh": Op(jnp.cosh, FLOATS), "erf": Op(lax.erf, FLOATS),
    "erfc": Op(lax.erfc, FLOATS), "erf_inv": Op(lax.erf_inv, FLOATS,
                                                domain="unit"),
    "floor": Op(jnp.floor, FLOATS), "ceil": Op(jnp.ceil, FLOATS),
    "round": Op(jnp.round, FLOATS), "is_finite": Op(jnp.isfinite, FLOATS),
    "pow": Op(jnp.power, FLOATS, 2, domain=_pos),
    "atan2": Op(jnp.arctan2, FLOATS, 2),
    "div": Op(lax.div, FLOATS + INTS, 2, domain=_pos),
    "rem": Op(lax.rem, FLOATS + INTS, 2, domain=_pos),
    # every dtype
    "abs": Op(jnp.abs, FLOATS + INTS[:2]), "neg": Op(jnp.negative,
                                                     FLOATS + INTS[:2]),
    "sign": Op(jnp.sign, FLOATS + INTS[:2]),
    "square": Op(jnp.square, FLOATS + INTS),
    "integer_pow": Op(lambda x: x ** 3, FLOATS + INTS),
    "add": Op(jnp.add, FLOATS + INTS, 2), "sub": Op(jnp.subtract,
                                                    FLOATS + INTS, 2),
    "mul": Op(jnp.multiply, FLOATS + INTS, 2),
    "max": Op(jnp.maximum, FLOATS + INTS, 2),
    "min": Op(jnp.minimum, FLOATS + INTS, 2),
    "lt": Op(jnp.less, FLOATS + INTS, 2), "eq": Op(jnp.equal, FLOATS + INTS,
                                                   2),
    "select_n": Op(lambda a, b: jnp.where(a > b, a, b), FLOATS + INTS, 2),
    "clamp": Op(lambda x: lax.clamp(x.dtype.type(1), x, x.dtype.type(9)),
                FLOATS + INTS),
    # bits
    "and": Op(jnp.bitwise_and, INTS + BOOLS, 2),
    "or": Op(jnp.bitwise_or, INTS + BOOLS, 2),
    "xor": Op(jnp.bitwise_xor, INTS + BOOLS, 2),
    "not": Op(jnp.invert, INTS + BOOLS),
    "shift_left": Op(lax.shift_left, INTS, 2, domain="small"),
    "shift_right_logical": Op(lax.shift_right_logical, INTS, 2,
                              domain="small"),
    "shift_right_arithmetic": Op(lax.shift_right_arithmetic, INTS, 2,
                                 domain="small"),
    "population_count": Op(lax.population_count, INTS),
    "clz": Op(lax.clz, INTS),
    # reductions and scans (along the last dim, and the first)
    "reduce_sum": Op(lambda x: jnp.sum(x, axis=1, keepdims=True),
                     FLOATS + INTS[:1]),
    "reduce_max": Op(lambda x: jnp.max(x, axis=1, keepdims=True),
                     FLOATS + INTS),
    "reduce_min": Op(lambda x: jnp.min(x, axis=0, keepdims=True),
                     FLOATS + INTS),
    "reduce_prod": Op(lambda x: jnp.prod(x, axis=0, keepdims=True), FLOATS,
                      domain="unit"),
    "argmax": Op(lambda x: jnp.argmax(x, axis=1, keepdims=True).astype(
        jnp.int32), FLOATS + INTS),
    "argmin": Op(lambda x: jnp.argmin(x, axis=0, keepdims=True).astype(
        jnp.int32), FLOATS + INTS),
    "reduce_or": Op(lambda x: jnp.any(x, axis=1, keepdims=True), BOOLS),
    "reduce_and": Op(lambda x: jnp.all(x, axis=1, keepdims=True), BOOLS),
    "cumsum": Op(lambda x: jnp.cumsum(x, axis=1), FLOATS[:1] + INTS[:1],
                 domain="unit"),
    "cummax": Op(lambda x: lax.cummax(x, axis=0), FLOATS + INTS[:1]),
}


def _inputs(name: str, dtype):
  op = OPS[name]
  seed = sum(map(ord, name))
  if dtype == jnp.bool_:
    return [testing.array(seed + i, SHAPE, dtype) for i in range(op.arity)]
  floating = jnp.issubdtype(dtype, jnp.floating)
  xs = []
  for i in range(op.arity):
    if op.domain == "small":
      x = testing.array(seed + i, SHAPE, dtype, 0, 8)
    elif not floating:
      lo = 1 if op.domain == _pos else (0 if dtype == jnp.uint8 else -50)
      x = testing.array(seed + i, SHAPE, dtype, lo, 50)
    elif op.domain == _pos:
      x = jnp.abs(testing.array(seed + i, SHAPE, jnp.float32)) + 0.25
    elif op.domain == "unit":
      x = jnp.tanh(testing.array(seed + i, SHAPE, jnp.float32))
    else:
      x = testing.array(seed + i, SHAPE, jnp.float32, scale=2.0)
    xs.append(jnp.asarray(x).astype(dtype))
  return xs


def _primitives(jaxpr) -> set:
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive not in CALL_PRIMITIVES:
      out.add(eqn.primitive)
    for sub in sub_jaxprs(eqn.params):
      out |= _primitives(getattr(sub, "jaxpr", sub))
  return out


def unlowered(name: str, dtype, backend: str) -> list[str]:
  """The primitives of op `name` on `dtype` that `backend`'s rule table has
  no rule for, after the normalization its lowering applies."""
  record = backends.REGISTRY[backend]
  table = backends.rule_table(backend)
  avals = [jax.ShapeDtypeStruct(SHAPE, dtype)] * OPS[name].arity
  closed = jax.make_jaxpr(OPS[name].fn)(*avals)
  closed = normalize_closed(closed, values_in_memory=record.values_in_memory,
                            missing=fallbacks.missing(table))
  return sorted(p.name for p in _primitives(closed.jaxpr) if p not in table)


def _reference(name, xs):
  """jnp's result; 16-bit float math computed in float32 and rounded once,
  as every backend computes it."""
  fn = OPS[name].fn
  want = fn(*xs)
  if want.dtype in (jnp.bfloat16, jnp.float16):
    want = fn(*[x.astype(jnp.float32) for x in xs]).astype(want.dtype)
  return want


def _kernel(fn, arity):
  def kernel(*refs):
    o_ref = refs[arity]
    o_ref[...] = fn(*[r[...] for r in refs[:arity]])
  return kernel


def _cases():
  for name in sorted(OPS):
    for dtype in OPS[name].dtypes:
      for backend in BACKENDS:
        marks = [] if jnp.dtype(dtype) in DEFAULT_DTYPES else [
            pytest.mark.slow]
        yield pytest.param(name, dtype, backend, marks=marks,
                           id=f"{name}-{jnp.dtype(dtype).name}-{backend}")


def _run(name, dtype, backend, xs):
  op = OPS[name]
  out = jax.eval_shape(op.fn, *xs)
  call = pl.pallas_call(_kernel(op.fn, op.arity), out, backend=backend)
  if backend == "mosaic_gpu":
    return gpu_module(call, *xs)
  return jax.jit(call)(*xs)


@pytest.mark.parametrize("name,dtype,backend", list(_cases()))
def test_op_on_backend(name, dtype, backend):
  xs = _inputs(name, dtype)
  gaps = unlowered(name, dtype, backend)
  if gaps:
    with pytest.raises(pl.BackendError) as e:
      _run(name, dtype, backend, xs)
    named = any(f"primitive '{g}'" in str(e.value) for g in gaps)
    # Mosaic GPU may refuse the kernel's memory before it meets the primitive
    assert named or backend == "mosaic_gpu", str(e.value)
    return
  try:
    got = _run(name, dtype, backend, xs)
  except pl.BackendError as e:
    if backend == "mosaic_gpu":
      # jaxlib's Mosaic GPU library refuses some layouts and dtypes (8-bit
      # arithmetic, bool arrays, float rem, erf): a BackendError naming the
      # kernel, never a crash
      assert "kernel 'kernel'" in str(e), str(e)
      return
    # a rule that takes the primitive but not this dtype says so
    assert jnp.dtype(dtype).name in str(e), str(e)
    return
  if backend == "mosaic_gpu":
    return
  want = _reference(name, xs)
  assert got.dtype == want.dtype and got.shape == want.shape
  if jnp.issubdtype(want.dtype, jnp.floating):
    tol = OPS[name].tol if dtype == jnp.float32 else None
    testing.assert_close(got, want, dtype, tol=tol)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_expected_gaps_come_from_the_rule_tables(monkeypatch):
  """A rule added to a table turns a gap into a lowering the table test
  then runs (no list in this file to update)."""
  table = backends.rule_table("mosaic_gpu")
  assert unlowered("clz", jnp.int32, "mosaic_gpu") == ["clz"]
  monkeypatch.setitem(table._by_key, lax.clz_p, lambda ctx, x: x)
  assert unlowered("clz", jnp.int32, "mosaic_gpu") == []
