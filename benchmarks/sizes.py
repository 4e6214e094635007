"""Parsing `--sizes`: comma-separated sizes, dims joined by 'x', K/M/G suffixes.

    --sizes 4M,1024           two sizes of one dim
    --sizes 1024x512x256      one size of three dims (matmul: M x K x N)
"""
from __future__ import annotations

import re

from benchmarks.usage_errors import UsageError

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_DIM = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)\s*$")


def parse_dim(text: str) -> int:
  m = _DIM.match(text)
  if not m:
    raise UsageError(f"malformed size dimension {text!r}: expected a positive "
                     "integer, optionally with a K, M or G suffix (4M = 4*2^20)")
  value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
  if value <= 0:
    raise UsageError(f"size dimension {text!r} must be positive")
  return value


def parse_sizes(text: str) -> list[tuple[int, ...]]:
  """'4M,64x64' -> [(4194304,), (64, 64)]."""
  if text is None or not text.strip():
    raise UsageError("--sizes is empty: give e.g. --sizes 4M or 1024x1024")
  sizes = []
  for item in text.split(","):
    if not item.strip():
      raise UsageError(f"malformed --sizes {text!r}: empty item")
    sizes.append(tuple(parse_dim(d) for d in re.split("[xX]", item.strip())))
  return sizes


def human(n: int) -> str:
  """4194304 -> '4M', 1024 -> '1024', 3072 -> '3K'."""
  for suffix, unit in (("G", 1 << 30), ("M", 1 << 20)):
    if n >= unit and n % unit == 0:
      return f"{n // unit}{suffix}"
  if n > 4096 and n % 1024 == 0:
    return f"{n // 1024}K"
  return str(n)


def label(size: tuple[int, ...]) -> str:
  return "x".join(human(d) for d in size)


def key(size: tuple[int, ...]) -> str:
  """The exact, unabbreviated form used in caches and JSON: '1024x1024x1024'."""
  return "x".join(str(int(d)) for d in size)
