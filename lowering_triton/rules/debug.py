"""Compiler hints and debugging: `multiple_of`/`max_contiguous` as Triton's
hints, `debug_print` as `tl.device_print`, run-time checks (`debug_check`,
`checkify.check`) as `tl.device_assert`.

dsl marks the checks of a kernel as run-time (`debug=False`) or debug-only
from jax_pallas_enable_runtime_assert and jax_pallas_enable_debug_checks
(dsl/core/checks.py); only run-time checks produce an assert.
"""
from __future__ import annotations

import re

from jax import tree_util
from dsl.core.jax_internals import checkify as jax_checkify

from dsl.core import checks
from dsl.core import primitives as dsl_primitives
from dsl.core.errors import source_info_frame
from lowering_triton import triton_dtypes as dtypes
from lowering_triton.rules import register


def _hint(fn: str):
  def rule(ctx, x, values, **params):
    if x.literal is not None or not dtypes.is_int(x.dtype):
      return x          # hints only matter for integer offsets
    values = tuple(int(v) for v in values)
    rank = max(1, len(x.shape))
    if len(values) == 1 and rank > 1:
      values = values * rank
    if len(values) != rank:
      return x
    arg = values[0] if len(values) == 1 else list(values)
    return ctx.bind(f"tl.{fn}({x.expr}, {arg})", x.shape, x.dtype,
                    ctx.hint(x.expr if x.expr.isidentifier() else fn))
  return rule


register(dsl_primitives.multiple_of_p)(_hint("multiple_of"))
register(dsl_primitives.max_contiguous_p)(_hint("max_contiguous"))


def _prefixes(fmt: str, n: int) -> list[str]:
  """The text before each `{}` placeholder of `fmt`."""
  pieces = re.split(r"\{[^{}]*\}", fmt)
  out = [p.strip() for p in pieces[:n]]
  return out + [""] * (n - len(out))


@register(dsl_primitives.debug_print_p)
def _debug_print(ctx, *args, fmt, **params):
  ctx.host.has_side_effects = True
  if not args:
    ctx.emit(f"tl.device_print({fmt!r})")
    return []
  for prefix, a in zip(_prefixes(fmt, len(args)), args):
    ctx.emit(f"tl.device_print({prefix!r}, {ctx.value(a)})")
  return []


@register(jax_checkify.check_p)
def _check(ctx, *args, err_tree, debug, **params):
  if debug:
    ctx.emit("# a debug-only check: skipped")
    return []
  error = tree_util.tree_unflatten(err_tree, list(args))
  where = source_info_frame(ctx.eqn.source_info) or ctx.host.where
  ctx.host.uses_asserts = True
  ctx.host.has_side_effects = True
  for effect, failed in error._pred.items():
    code = error._code.get(effect) if isinstance(error._code, dict) else None
    code = int(code.literal) if getattr(code, "literal", None) is not None \
        else None
    text = checks.check_text(checks.check_message(error, code), where)
    ok = (f"~{failed.expr}" if failed.expr.isidentifier()
          else f"~({failed.expr})")
    if failed.literal is not None:
      if not failed.literal:
        continue
      ok = "False"
    ctx.emit(f"tl.device_assert({ok}, {text!r})")
  return []
