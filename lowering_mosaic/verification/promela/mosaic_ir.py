"""What the Promela extractor reads off a Mosaic module: the sizes and
memory spaces of its types, the kernel source lines of its locations, and
the table of op rules (`OPS`, a `RuleTable` of op name -> rule(extractor, op, env, out),
filled by the ops_*.py and views.py modules)."""
from __future__ import annotations

import math
import re
from typing import Optional

from dsl.core.jax_internals import ir

from dsl.core.jaxpr_walk import RuleTable
from lowering_mosaic import dialect


class ModelError(Exception):
  """The module uses something the Promela export cannot model."""


# ------------------------------------------------------------ types

_ITEMSIZE = {"f64": 8, "i64": 8, "f32": 4, "i32": 4, "bf16": 2, "f16": 2,
             "i16": 2, "i8": 1, "i1": 1, "f8E4M3FN": 1, "f8E5M2": 1,
             "i4": 1, "index": 8}


def itemsize(elt) -> int:
  return _ITEMSIZE.get(str(elt), 4)


def is_int(t) -> bool:
  return isinstance(t, ir.IntegerType) or isinstance(t, ir.IndexType)


def is_memref(t) -> bool:
  return isinstance(t, ir.MemRefType)


space = dialect.memref_space
sem_kind = dialect.semaphore_kind_of


def shape_of(t) -> tuple:
  return tuple(int(d) if d >= 0 else 1 for d in ir.ShapedType(t).shape)


def nbytes_of(t) -> int:
  st = ir.ShapedType(t)
  return math.prod(shape_of(t)) * itemsize(st.element_type)


# ------------------------------------------------------------ locations

_FILE_LOC = re.compile(r'"(?P<file>[^"]+)":(?P<line>\d+):\d+')
_NAME_LOC = re.compile(r'loc\("(?P<name>[^"]+)"\(')


def short(line: Optional[str]) -> str:
  """'kernel.py:12' for '/long/path/kernel.py:12' (names, not locations)."""
  if not line:
    return "?"
  path, _, num = line.rpartition(":")
  return f"{path.rsplit('/', 1)[-1]}:{num}"


def location_of(op) -> tuple[Optional[str], Optional[str]]:
  """('file:line' or None, op name from a NameLoc or None). JAX's format
  names the primitive with a colon (`loc("get:"("get"(...)))`); the name
  is given without it."""
  text = str(op.location)
  m = _FILE_LOC.search(text)
  line = f"{m.group('file')}:{m.group('line')}" if m else None
  n = _NAME_LOC.match(text)
  return line, (n.group("name").removesuffix(":") if n else None)


# ------------------------------------------------------------ op rules

OPS = RuleTable("the Promela extractor")
handles = OPS.register
