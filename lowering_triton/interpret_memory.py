"""Memory safety of the triton_interpret backend.

Triton's interpreter reads and writes through raw addresses (its C++ load,
store and atomics take numpy arrays of pointers). A pointer outside every
buffer of the run -- a `pl.ds` whose start was read from data, an index
computed from loaded values -- would read or corrupt the host process's
memory, and a non-contiguous value array (a broadcast scalar has zero
strides) was read past its first element.

While a kernel runs, `guard(buffers, ...)` holds the address range of every
buffer; the builder's loads, stores and atomics are patched (see
`install`) to pass contiguous arrays and to check each active lane's address
against those ranges. A lane outside them is dropped (a load gives its
`other`, a store or atomic writes nothing); with
`jax_pallas_enable_runtime_assert` on it is reported instead, as
`OutOfBounds`, which the backend turns into a KernelRuntimeError naming the
kernel, the operand and the user's source line.

The masked-off lanes of a load without `other` read poison
(`dsl.core.poison`), as on every host backend: the generated source leaves
`other` out where nothing defines those lanes, which on a GPU lets Triton
copy a tile straight to shared memory (the lanes hold whatever they held).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from dsl.core.poison import poison_value
from lowering_triton import triton_dtypes as dtypes


class OutOfBounds(Exception):
  """An active lane's address is outside every buffer of the run."""


@dataclasses.dataclass
class _Bounds:
  names: list[str]
  starts: np.ndarray      # sorted start addresses (uint64)
  ends: np.ndarray        # one past the last byte
  report: bool            # raise OutOfBounds instead of dropping the lane

  def lanes_inside(self, ptrs: np.ndarray, itemsize: int) -> np.ndarray:
    k = np.searchsorted(self.starts, ptrs, side="right") - 1
    k_ok = k >= 0
    kc = np.where(k_ok, k, 0)
    return k_ok & (ptrs + np.uint64(itemsize) <= self.ends[kc])

  def nearest(self, ptr: int) -> str:
    k = int(np.searchsorted(self.starts, np.uint64(ptr), side="right")) - 1
    if k < 0:
      return f"before {self.names[0]}"
    off = ptr - int(self.starts[k])
    return f"{self.names[k]} + {off} bytes (its size is " \
           f"{int(self.ends[k] - self.starts[k])} bytes)"


_ACTIVE: list[_Bounds] = []


@contextlib.contextmanager
def guard(buffers: dict[str, np.ndarray], report: bool):
  """Bounds every access of the kernel run inside to `buffers`
  (parameter name -> numpy array)."""
  items = sorted(((int(a.ctypes.data), int(a.ctypes.data) + a.nbytes, name)
                  for name, a in buffers.items()), key=lambda t: t[0])
  bounds = _Bounds([n for _, _, n in items],
                   np.array([s for s, _, _ in items], np.uint64),
                   np.array([e for _, e, _ in items], np.uint64), report)
  _ACTIVE.append(bounds)
  try:
    yield
  finally:
    _ACTIVE.pop()


def _checked_mask(ptrs, mask, itemsize: int, verb: str):
  """`mask` (broadcast to `ptrs`, contiguous) with the lanes outside every
  buffer dropped, or OutOfBounds when those are to be reported."""
  ptrs = np.ascontiguousarray(ptrs)
  if mask is None:
    mask = np.ones(ptrs.shape, bool)
  mask = np.ascontiguousarray(np.broadcast_to(np.asarray(mask, bool),
                                              ptrs.shape))
  if not _ACTIVE:
    return ptrs, mask
  bounds = _ACTIVE[-1]
  inside = bounds.lanes_inside(ptrs, itemsize)
  bad = mask & ~inside
  if bad.any():
    if bounds.report:
      first = int(ptrs[bad].reshape(-1)[0])
      raise OutOfBounds(
          f"out-of-bounds {verb}: {int(bad.sum())} active lane(s) address "
          f"memory outside every operand, first at {bounds.nearest(first)}")
    mask = mask & inside
    # the dropped lanes' addresses are never dereferenced; keep them valid
    ptrs = np.where(mask, ptrs, bounds.starts[0])
  return ptrs, mask


def _handle(ti, data, like):
  return ti.TensorHandle(np.ascontiguousarray(data), like.dtype)


def _poison(ti, ptrs, shape):
  """Poison lanes of the element type `ptrs` point at, as the interpreter
  stores that type (bfloat16 and float8 as unsigned integers)."""
  element = ptrs.get_element_ty()
  value = np.asarray(poison_value(dtypes.from_tl(element)),
                     dtypes.from_tl(element))
  storage = ti._get_np_dtype(element)
  return ti.TensorHandle(np.full(shape, value.view(storage)), element)


def _masked_load(original, ti):
  def create_masked_load(self, ptrs, mask, other, *rest, **kw):
    # (tensor descriptor loads pass their hints by keyword)
    itemsize = ti._get_np_dtype(ptrs.get_element_ty()).itemsize
    p, m = _checked_mask(ptrs.data, None if mask is None else mask.data,
                         itemsize, "load")
    if other is not None:
      other = _handle(ti, np.broadcast_to(other.data, p.shape), other)
    elif not m.all():
      other = _poison(ti, ptrs, p.shape)
    return original(self, _handle(ti, p, ptrs), ti.TensorHandle(m, _int1()),
                    other, *rest, **kw)
  return create_masked_load


def _masked_store(original, ti):
  def create_masked_store(self, ptrs, value, mask, *rest, **kw):
    p, m = _checked_mask(ptrs.data, None if mask is None else mask.data,
                         value.data.dtype.itemsize, "store")
    value = _handle(ti, np.broadcast_to(value.data, p.shape), value)
    return original(self, _handle(ti, p, ptrs), value,
                    ti.TensorHandle(m, _int1()), *rest, **kw)
  return create_masked_store


def _atomic_rmw(original, ti):
  def create_atomic_rmw(self, op, ptr, val, mask, sem, scope):
    p, m = _checked_mask(ptr.data, None if mask is None else mask.data,
                         val.data.dtype.itemsize, "atomic update")
    val = _handle(ti, np.broadcast_to(val.data, p.shape), val)
    return original(self, op, _handle(ti, p, ptr), val,
                    ti.TensorHandle(m, _int1()), sem, scope)
  return create_atomic_rmw


def _atomic_cas(original, ti):
  def create_atomic_cas(self, ptr, cmp, val, sem, scope):
    p, m = _checked_mask(ptr.data, None, val.data.dtype.itemsize,
                         "atomic compare-and-swap")
    if not m.all():             # a compare-and-swap has no mask to drop by
      raise OutOfBounds("out-of-bounds atomic compare-and-swap")
    cmp = _handle(ti, np.broadcast_to(cmp.data, p.shape), cmp)
    val = _handle(ti, np.broadcast_to(val.data, p.shape), val)
    return original(self, _handle(ti, p, ptr), cmp, val, sem, scope)
  return create_atomic_cas


def _int1():
  import triton.language as tl
  return tl.int1


_PATCHES = {"create_masked_load": _masked_load,
            "create_masked_store": _masked_store,
            "create_atomic_rmw": _atomic_rmw,
            "create_atomic_cas": _atomic_cas}


def install(ti, scope) -> None:
  """Patches the interpreter builder's memory operations within `scope`."""
  for name, wrap in _PATCHES.items():
    scope.set_attr(ti.InterpreterBuilder, name,
                   wrap(getattr(ti.InterpreterBuilder, name), ti))
