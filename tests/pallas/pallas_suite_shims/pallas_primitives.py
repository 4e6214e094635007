"""What JAX's Pallas tests take from Pallas's private primitives module
(`jax._src.pallas.primitives`), on dsl: dsl's masked `load` and `store`
(`dsl.triton.load` / `store`), and `swap`, which dsl has no primitive for,
written as a masked load and a masked store."""
from dsl.core.ref_ops import load, store


def swap(ref, idx, val, *, mask=None):
  """Writes `val` to `ref[idx]` where `mask` is True and returns what was
  there (`val` where `mask` is False), as Pallas's `swap`."""
  old = load(ref, idx, mask=mask, other=None if mask is None else val)
  store(ref, idx, val, mask=mask)
  return old


__all__ = ["load", "store", "swap"]
