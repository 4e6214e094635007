"""Fix-it hints for the mistakes kernel authors make most.

When tracing a kernel body raises, `hint(exc, ctx)` looks the exception up in
a small rule table and returns a message that says how to fix the kernel
(read a ref with `x_ref[...]`, cast with `.astype(o_ref.dtype)`, give the
BlockSpec that was forgotten), or None to keep JAX's own message.
"""
from __future__ import annotations

import dataclasses
import linecache
import math
import re
from typing import Any, Callable

import numpy as np
from jax import errors as jax_errors

_GRID_NAMES = "ijklmn"


@dataclasses.dataclass
class HintContext:
  """What a rule knows about the failing statement."""
  operand: str | None          # "o_ref (out_specs[0])", or None
  where: str | None            # the user's "file:line"
  params: dict[str, Any]       # kernel parameter name -> BlockMapping or None
  grid: tuple[int, ...]
  labels: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def param(self) -> str | None:
    return self.operand.split(" ")[0] if self.operand else None


def _source_line(where: str | None) -> str:
  if not where or ":" not in where:
    return ""
  filename, _, line = where.rpartition(":")
  return linecache.getline(filename, int(line)) if line.isdigit() else ""


def _refs_used_as_values(ctx: HintContext) -> list[str]:
  """Ref parameters that the failing line names without `[`, `.` or `(`."""
  line = _source_line(ctx.where).split("#")[0]
  found = []
  for name in ctx.params:
    if re.search(rf"(?<![\w.]){re.escape(name)}\b(?!\s*[\[.(=])", line):
      found.append(name)
  return found


def _ref_as_value(m, exc, ctx: HintContext) -> str | None:
  if isinstance(exc, AttributeError):
    name = ctx.param          # the ref whose attribute was asked for
  else:
    used = _refs_used_as_values(ctx)   # the line names it without `[...]`
    name = used[0] if len(used) == 1 else None
  if name is None:
    return None
  if name in ctx.labels:
    ctx.operand = ctx.labels[name]
  return (f"{name} is a ref, not a value: read it with `{name}[...]` "
          f"({type(exc).__name__}: {exc})")


def _wrong_dtype(m, exc, ctx: HintContext) -> str:
  op, ref_dtype, value_dtype = m.group(1), m.group(2), m.group(3)
  name = ctx.param or "o_ref"
  verb = "adding" if op == "addupdate" else "storing"
  return (f"{verb} {value_dtype} values into {name}, a {ref_dtype} ref: "
          f"cast it first with `.astype({name}.dtype)`")


def _blockspec_text(value_shape, array_shape, grid) -> str:
  """A BlockSpec of `value_shape` blocks over `grid`, as source text."""
  args = [_GRID_NAMES[a] for a in range(len(grid))] or ["()"]
  used, idx = set(), []
  for v, n in zip(value_shape, array_shape):
    axis = next((a for a, g in enumerate(grid)
                 if a not in used and v and -(-n // v) == g and v != n), None)
    if axis is None:
      idx.append("0")
    else:
      used.add(axis)
      idx.append(_GRID_NAMES[axis])
  lam = ", ".join(args) if grid else ""
  tup = ", ".join(idx) + ("," if len(idx) == 1 else "")
  return f"pl.BlockSpec({tuple(value_shape)}, lambda {lam}: ({tup}))"


def _shape_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(t) for t in re.findall(r"\d+", text))


def _wrong_shape(m, exc, ctx: HintContext) -> str | None:
  ref_shape, value_shape = _shape_tuple(m.group(2)), _shape_tuple(m.group(3))
  name = ctx.param
  bm = ctx.params.get(name) if name else None
  if bm is not None and bm.whole_array and ref_shape == bm.kernel_shape:
    kind = bm.origin.split("[")[0]
    if len(value_shape) == len(bm.array_aval.shape):
      fit = (" A BlockSpec that fits the value: "
             f"{bm.origin} = {_blockspec_text(value_shape, bm.array_aval.shape, ctx.grid)}.")
    else:
      fit = ""
    return (f"the value stored has shape {value_shape}, but {name} is the "
            f"whole array {ref_shape}: {bm.origin} has no BlockSpec (no "
            f"`{kind}` means the whole array).{fit}")
  for other, obm in ctx.params.items():
    if (obm is not None and obm.whole_array and obm.origin.startswith("in_")
        and obm.kernel_shape == value_shape and ref_shape != value_shape):
      fit = _blockspec_text(ref_shape, obm.array_aval.shape, ctx.grid)
      ctx.operand = ctx.labels.get(other, ctx.operand)
      return (f"the value stored into {name or 'the ref'} has shape "
              f"{value_shape}, the whole array of {other}: {obm.origin} has "
              f"no BlockSpec (no `in_specs` means the whole array). A "
              f"BlockSpec that gives {other} blocks of {ref_shape}: "
              f"{obm.origin} = {fit}.")
  return _shape_fix(name or "the ref", _expected_shape(exc) or ref_shape,
                    value_shape)


def _expected_shape(exc) -> tuple[int, ...] | None:
  m = re.search(r"Expected shape: (\([\d, ]*\))", str(exc))
  return _shape_tuple(m.group(1)) if m else None


def _shape_fix(name: str, want, got) -> str:
  """What to do about a value of shape `got` stored where `want` goes."""
  text = (f"the value stored into {name} has shape {got}, but the window it "
          f"is stored into has shape {want}: ")
  if math.prod(want) == math.prod(got):
    return text + f"reshape it first (`.reshape({want})`)"
  try:
    np.broadcast_shapes(got, want)
    fits = np.broadcast_shapes(got, want) == tuple(want)
  except ValueError:
    fits = False
  if fits:
    return text + (f"broadcast it first (`jnp.broadcast_to(value, {want})`): "
                   "a store does not broadcast" + (
                       "; or, if a reduction dropped an axis, keep it with "
                       "`keepdims=True`" if len(got) < len(want) else ""))
  if len(got) < len(want):
    return text + ("a reduction drops the axis it reduces: keep it with "
                   "`keepdims=True`, or store into a window of the value's "
                   f"shape (`{name}[0] = ...`)")
  return text + ("store into a window of the value's shape "
                 f"(`{name}[pl.ds(start, {got[0] if got else 1}), ...] = "
                 "...`), or give the BlockSpec the value's block shape")


_ERRORS_PAGE = "https://docs.jax.dev/en/latest/errors.html#jax.errors."


def _traced_condition(m, exc, ctx: HintContext) -> str:
  ctx.operand = None
  first = str(exc).strip().splitlines()[0]
  return ("a Python `if`, `while`, `and`/`or`/`not` or `bool()` needs the "
          "truth of a value that is known only when the kernel runs (it is "
          "traced): run a block of code under `@pl.when(cond)`, pick between "
          "two computations with `jax.lax.cond(cond, f, g, ...)`, or pick "
          "values with `jnp.where(cond, a, b)` "
          f"(JAX: {first} See {_ERRORS_PAGE}{type(exc).__name__})")


def _traced_integer(m, exc, ctx: HintContext) -> str:
  ctx.operand = None
  first = str(exc).strip().splitlines()[0]
  return ("a Python int (for `range`, a list index, a shape) is needed of a "
          "value known only when the kernel runs (it is traced): loop with "
          "`jax.lax.fori_loop(0, n, body, carry)` (or `pl.loop`), index refs "
          "with the traced value itself (`x_ref[i]`, `x_ref[pl.ds(i, 8)]`), "
          "and keep shapes static "
          f"(JAX: {first} See {_ERRORS_PAGE}{type(exc).__name__})")


# (exception types, pattern on str(exc), rule(match, exc, ctx) -> str | None)
RULES: list[tuple[tuple[type, ...], re.Pattern, Callable]] = [
    ((jax_errors.TracerBoolConversionError,), re.compile(""),
     _traced_condition),
    ((jax_errors.TracerIntegerConversionError,
      jax_errors.ConcretizationTypeError), re.compile(""), _traced_integer),
    ((AttributeError,), re.compile(r"'AbstractRef' object has no attribute"),
     _ref_as_value),
    ((TypeError,), re.compile(r"DynamicJaxprTracer|AbstractRef|got a Ref "),
     _ref_as_value),
    ((ValueError, TypeError),
     re.compile(r"Invalid dtype for `(swap|addupdate)`\. Ref dtype: (\w+)\. "
                r"Value dtype: (\w+)"), _wrong_dtype),
    ((ValueError,),
     re.compile(r"Invalid shape for `(swap|addupdate)`\. Ref shape: "
                r"(\([\d, ]*\))\..*Value shape: (\([\d, ]*\))"), _wrong_shape),
]


def hint(exc: BaseException, ctx: HintContext) -> str | None:
  """A message saying how to fix the kernel, or None."""
  text = str(exc)
  for types, pattern, rule in RULES:
    if isinstance(exc, types) and (m := pattern.search(text)):
      if (msg := rule(m, exc, ctx)) is not None:
        return msg
  return None
