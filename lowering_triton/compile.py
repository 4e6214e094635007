"""Compiling generated kernels with the `triton` package.

`compile_kernel(gk, arch)` runs `triton.compile` on the generated source for
a CUDA compute capability (a GPU need not be present: Triton ships ptxas).
Results are cached in memory by source, signature, options and target.
"""
from __future__ import annotations

import re
import threading

from dsl.core.errors import BackendError
from lowering_triton import loader
from lowering_triton.interpret_launch import user_line

_CACHE: dict = {}
_LOCK = threading.Lock()


def _options(gk) -> dict:
  # debug=True turns tl.device_assert on; integer-overflow sanitizing, which
  # it would also turn on, stays off (kernels may wrap on purpose).
  return dict(num_warps=gk.num_warps, num_stages=gk.num_stages,
              num_ctas=gk.num_ctas, debug=gk.debug, sanitize_overflow=False,
              enable_fp_fusion=gk.enable_fp_fusion)


def cache_key(gk, arch, backend: str = "cuda") -> tuple:
  return (gk.source, tuple(sorted(gk.signature.items())),
          tuple(sorted(_options(gk).items())), backend, arch)


def _def_line(source: str, fn_name: str) -> int:
  for i, line in enumerate(source.splitlines(), 1):
    if line.startswith(f"def {fn_name}("):
      return i
  return 1


def _user_line_of_error(gk, err) -> tuple[int | None, str | None]:
  node = getattr(err, "node", None)
  lineno = getattr(node, "lineno", None)
  if lineno is None:
    m = re.search(r"at (\d+):\d+:", str(err))
    lineno = int(m.group(1)) if m else None
  if lineno is None:
    return None, None
  absolute = _def_line(gk.source, gk.fn_name) + lineno - 1
  return absolute, user_line(gk.source, absolute)


def compile_kernel(gk, arch: int, backend: str = "cuda", warp_size: int = 32):
  """`triton.compile` of a GeneratedKernel for `arch` (e.g. 90 for sm_90)."""
  key = cache_key(gk, arch, backend)
  with _LOCK:
    hit = _CACHE.get(key)
  if hit is not None:
    return hit
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  fn = loader.jit_function(gk)
  attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(gk.params))}
  src = ASTSource(fn, gk.signature, constexprs={}, attrs=attrs)
  try:
    compiled = triton.compile(src, target=GPUTarget(backend, arch, warp_size),
                              options=_options(gk))
  except Exception as e:
    lineno, where = _user_line_of_error(gk, e)
    first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    raise BackendError(
        gk.name, f"Triton failed to compile the generated kernel for "
        f"{backend} {arch}" + (f" (generated line {lineno})" if lineno else "")
        + f": {type(e).__name__}: {first}", where or gk.where,
        detail=f"Generated source:\n{gk.source}") from e
  with _LOCK:
    _CACHE[key] = compiled
  return compiled
