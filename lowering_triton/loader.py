"""Generated source -> a live `triton.JITFunction`.

The source is registered with `linecache` under a stable pseudo file name,
so Triton (which reads kernel source through `inspect`) and tracebacks see
it like a file on disk.
"""
from __future__ import annotations

import functools
import hashlib
import linecache


def filename_of(source: str, fn_name: str) -> str:
  digest = hashlib.sha256(source.encode()).hexdigest()[:12]
  return f"<lowering_triton {fn_name} {digest}>"


@functools.lru_cache(maxsize=512)
def load_module(source: str, fn_name: str) -> dict:
  """Executes the generated module and returns its namespace."""
  filename = filename_of(source, fn_name)
  linecache.cache[filename] = (len(source), None, source.splitlines(True),
                               filename)
  namespace = {"__name__": f"lowering_triton_generated_{fn_name}",
               "__file__": filename}
  exec(compile(source, filename, "exec"), namespace)
  return namespace


def jit_function(gk):
  """The `@triton.jit` function of a GeneratedKernel."""
  return load_module(gk.source, gk.fn_name)[gk.fn_name]
