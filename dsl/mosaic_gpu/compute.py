"""The compute primitives of `plgpu`: WGMMA into an accumulator, register
layouts, the register budget of a warpgroup, and reads in a layout.

- `wgmma(acc, a, b)`: `acc += a @ b` on the tensor cores, with `a` in SMEM or
  in registers (an array) and `b` in SMEM, accumulated in `acc`'s dtype. It
  runs asynchronously: `wgmma_wait(n)` waits until at most `n` are in
  flight, and a read of `acc` waits for all.
- `layout_cast(x, layout)`: `x`, kept in `layout` (`Layout.WGMMA`, ...). A
  layout says where an array's elements live among a warpgroup's threads;
  it never changes a value.
- `set_max_registers(n, action=)`: the warpgroup gives back or takes
  registers (a producer needs few, consumers many); values are unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.jax_internals import batching, core, mlir, state_types
from dsl.core.operand_layout import pack
from dsl.mosaic_gpu.memory import SMEM, check_layout, is_accumulator_aval, space_of
from dsl.mosaic_gpu.primitives import (gpu_effect, ref_effects, ref_parts,
                                       view_aval)

# ------------------------------------------------------------------- wgmma

wgmma_p = Primitive("wgmma")
wgmma_p.multiple_results = True


@wgmma_p.def_effectful_abstract_eval
def _wgmma_abstract_eval(*avals, layout, a_is_ref):
  reads = ("acc", "a", "b") if a_is_ref else ("acc", "b")
  return [], ref_effects(layout, reads=reads, writes=("acc",))


def _operand(what, x):
  """(value or ref, transforms, is_ref, aval) of a wgmma operand."""
  if isinstance(x, state_types.TransformedRef) or isinstance(
      core.typeof(x), state_types.AbstractRef):
    ref, transforms = ref_parts(what, x)
    if space_of(core.typeof(ref)) is not SMEM:
      raise KernelTypeError(None, f"wgmma's {what} must be in SMEM (or, for "
                            f"a, an array in registers), got a ref in "
                            f"{space_of(core.typeof(ref))}", user_frame(),
                            operand=what)
    return ref, transforms, True, view_aval(ref, transforms)
  if what != "a":
    raise KernelTypeError(None, "wgmma's b must be a ref in SMEM",
                          user_frame(), operand=what)
  x = jnp.asarray(x)
  return x, (), False, core.ShapedArray(x.shape, x.dtype)


def wgmma(acc, a, b) -> None:
  """`acc += a @ b` (asynchronous; `wgmma_wait` or a read of `acc` waits)."""
  acc_ref, acc_t = ref_parts("acc", acc)
  if not is_accumulator_aval(core.typeof(acc_ref)):
    raise KernelTypeError(None, "wgmma's acc must be a plgpu.ACC "
                          "accumulator (pl.run_scoped(f, plgpu.ACC(shape)))",
                          user_frame(), operand="acc")
  acc_aval = view_aval(acc_ref, acc_t)
  a_val, a_t, a_is_ref, a_aval = _operand("a", a)
  b_ref, b_t, _, b_aval = _operand("b", b)
  if len(a_aval.shape) != 2 or len(b_aval.shape) != 2 or (
      a_aval.shape[1] != b_aval.shape[0]) or acc_aval.shape != (
          a_aval.shape[0], b_aval.shape[1]):
    raise KernelError(None, f"wgmma: acc {acc_aval.str_short()} += a "
                      f"{a_aval.str_short()} @ b {b_aval.str_short()}: the "
                      "shapes must be (m, n) += (m, k) @ (k, n)", user_frame(),
                      operand="b")
  if a_aval.dtype != b_aval.dtype:
    raise KernelTypeError(None, f"wgmma: a is {a_aval.dtype} but b is "
                          f"{b_aval.dtype}; they must have the same dtype",
                          user_frame(), operand="b")
  flat, layout = pack(acc=acc_ref, acc_t=acc_t, a=a_val, a_t=a_t, b=b_ref,
                      b_t=b_t)
  wgmma_p.bind(*flat, layout=layout, a_is_ref=a_is_ref)


wgmma_wait_p = Primitive("wgmma_wait")
wgmma_wait_p.multiple_results = True
wgmma_wait_p.def_effectful_abstract_eval(lambda *, n: ([], {gpu_effect}))


def wgmma_wait(n: int) -> None:
  """Waits until at most `n` WGMMAs of this warpgroup are in flight."""
  wgmma_wait_p.bind(n=int(n))


# ------------------------------------------------------------------ layouts

layout_cast_p = Primitive("layout_cast")
layout_cast_p.def_abstract_eval(lambda aval, *, new_layout: aval)
layout_cast_p.def_impl(lambda x, *, new_layout: x)
mlir.register_lowering(layout_cast_p, lambda ctx, x, *, new_layout: [x])
batching.primitive_batchers[layout_cast_p] = (
    lambda args, dims, **p: (layout_cast_p.bind(args[0], **p), dims[0]))


def layout_cast(x, new_layout):
  """`x`, kept in register layout `new_layout`."""
  return layout_cast_p.bind(jnp.asarray(x), new_layout=check_layout(new_layout))


def broadcasted_iota(dtype, shape, dimension, *, layout=None):
  """`lax.broadcasted_iota` in register layout `layout`."""
  x = lax.broadcasted_iota(dtype, shape, dimension)
  return x if layout is None else layout_cast(x, layout)


def load(src, *, layout=None, optimized: bool = True):
  """All of `src` (a ref, or a view of one: `x.at[i]`) read into registers
  in layout `layout`."""
  del optimized
  x = src[...]
  return x if layout is None else layout_cast(x, layout)


def store(dst, value, *, optimized: bool = True) -> None:
  """`value` written to all of `dst` (SMEM or GMEM)."""
  del optimized
  dst[...] = value


def wgmma_accumulator_load(acc, *, wait_n: int | None = 0):
  """The value of accumulator `acc` (after waiting until at most `wait_n`
  WGMMAs are in flight)."""
  if wait_n is not None and wait_n < 0:
    raise KernelError(None, f"wait_n must be non-negative, got {wait_n}",
                      user_frame(), operand="wait_n")
  if wait_n is not None:
    wgmma_wait(wait_n)
  return acc[...]


set_max_registers_p = Primitive("set_max_registers")
set_max_registers_p.multiple_results = True
set_max_registers_p.def_effectful_abstract_eval(
    lambda *, n, action: ([], {gpu_effect}))


def set_max_registers(n: int, *, action: str) -> None:
  """Sets this warpgroup's registers per thread to `n`
  (`action="increase"` or `"decrease"`)."""
  if action not in ("increase", "decrease"):
    raise KernelError(None, f"set_max_registers: action must be 'increase' "
                      f"or 'decrease', got {action!r}", user_frame(),
                      operand="action")
  if not 24 <= int(n) <= 256 or int(n) % 8:
    raise KernelError(None, f"set_max_registers: n must be a multiple of 8 "
                      f"between 24 and 256, got {n}", user_frame(),
                      operand="n")
  set_max_registers_p.bind(n=int(n), action=action)
