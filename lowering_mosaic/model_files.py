"""Where Promela models are written (`jax_pallas_dump_promela_to`): one
file per model, named by its kernel and its text's hash."""
from __future__ import annotations

import hashlib
import os
import re


def _safe(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "kernel"


def write_model(text: str, kernel_name: str, directory: str) -> str:
  """Writes DIR/<kernel name>-<8 hex digits of the text's sha1>.pml."""
  os.makedirs(directory, exist_ok=True)
  digest = hashlib.sha1(text.encode()).hexdigest()[:8]
  path = os.path.join(directory, f"{_safe(kernel_name)}-{digest}.pml")
  with open(path, "w") as fh:
    fh.write(text)
  return path
