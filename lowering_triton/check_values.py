"""The values a failed run-time check of the generated source reports.

A `tl.device_assert` carries a fixed message; the checks that every backend
words the same (a window placed at run time that leaves its ref, a block
index read from data outside its array: dsl/core/checks.py) also give the values
they failed on, the block index and the grid point. The generated line
names the source expressions of those values in a comment,

    tl.device_assert(ok, '... {}:{} ... {block} ... {point} ...')  # check values: values=(s, s + 8), block=(i, 0), point=(i, j)

and when Triton's interpreter fails the assert, `fill_in` evaluates them in
the generated kernel's frame and formats the message. On a GPU the message
prints as written.
"""
from __future__ import annotations

import re

import numpy as np

_COMMENT = "# check values: "
_FIELDS = re.compile(r"#\s*check values: (.*)$")


def _tuple(items) -> str:
  items = [str(i) for i in items]
  if len(items) == 1:
    return f"({items[0]},)"
  return f"({', '.join(items)})"


def check_values_comment(lowering, values, block) -> str:
  """The comment that names a check's values, its block index (`block`:
  Syms, empty for refs without a block) and the grid point."""
  fields = [f"values={_tuple(values)}", f"point={_tuple(lowering.grid_point)}"]
  if block:
    fields.append(f"block={_tuple(block)}")
  return _COMMENT + ", ".join(fields)


def _ints(value) -> list[int]:
  items = value if isinstance(value, tuple) else (value,)
  out = []
  for v in items:
    data = getattr(getattr(v, "handle", None), "data", v)
    out.append(int(np.asarray(data).reshape(-1)[0]))
  return out


def fill_in(message: str, line: str, frame) -> str:
  """`message` with the values the comment on generated `line` names, read
  in the generated kernel's `frame`; `message` as it is when there are
  none."""
  m = _FIELDS.search(line or "")
  if m is None or frame is None:
    return message
  try:
    fields = eval(f"dict({m.group(1)})", dict(frame.f_globals),  # noqa: S307
                  dict(frame.f_locals))
    block = fields.get("block")
    return message.format(
        *_ints(fields["values"]),
        point=str(tuple(_ints(fields["point"]))),
        block="()" if block is None else str(tuple(_ints(block))))
  except Exception:  # noqa: BLE001 - a value the frame no longer holds
    return message
