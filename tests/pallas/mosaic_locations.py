"""The locations of a Mosaic custom call's operations, for the golden tests.

The golden tests compare the two lowerings' modules without locations
(mosaic_golden.py); the locations get this check of their own, because ours
are not Pallas's and need not be (docs/mosaic.md, "Locations"): Pallas's
lowering cache gives repeated equations the first one's location and merged
constants none, where ours give every equation its own. What is required:

- every user frame our locations name is a line of the user's source that
  defines the kernel or its index maps: a line inside a function (or lambda)
  of that name in one of the case's source files (`check_frames`);
- every operation Pallas locates at a user line is located at one by us too,
  and the ref arguments carry the same names (`check_against`).

Where the call carries `debug_locations` (jax 0.12 moves the operations'
locations out of the module into a list in walk order) they are put back on
their operations; otherwise (jax 0.11) the module keeps its own.
"""
from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import re

from dsl.core.jax_internals import ir

# A user frame of a JAX location: `"qualname"("file":line:col ...` (jax
# 0.12) or `"file":line:col` (jax 0.11).
_FRAME = re.compile(
    r'(?:"(?P<name>[^"]*)"\()?"(?P<file>[^"]+)":(?P<line>\d+):\d+')
_NAME_ONLY = re.compile(r'^loc\("([^"]*)"\)$')


@dataclasses.dataclass
class Located:
  """What the golden tests compare of one call's locations."""
  # (function name or None, file, line) of every user frame named
  frames: set
  # the entry function's argument names (None for an unnamed argument)
  arg_names: list
  # per function, each non-constant operation after canonicalization as
  # (operation name, whether a user frame locates it)
  ops: dict


def _walk_located(op):
  """An operation, then its regions' block arguments and operations, in the
  order `debug_locations` lists their locations."""
  yield op
  for region in op.regions:
    for block in region.blocks:
      yield from block.arguments
      for inner in block.operations:
        yield from _walk_located(inner.operation)


def _split_list(text: str) -> list[str]:
  """The items of a printed `[a, b, ...]` attribute list (commas inside
  parentheses or quotes do not split)."""
  items, depth, quoted, start = [], 0, False, 1
  for k, ch in enumerate(text):
    if quoted:
      quoted = ch != '"' or text[k - 1] == "\\"
    elif ch == '"':
      quoted = True
    elif ch in "([":
      depth += 1
    elif ch in ")]":
      depth -= 1
    if depth == 0 or (depth == 1 and ch == "," and not quoted):
      items.append(text[start:k].strip())
      start = k + 1
  return [i for i in items if i]


def _locations(locations_b64: str):
  """The locations a `debug_locations` holds, in order. (The bindings cannot
  turn its attributes into Locations, so each is parsed from its text.)"""
  holder = ir.Module.parse(base64.b64decode(locations_b64))
  text = str(holder.operation.attributes["tpu.locs"])
  cache = {}
  for item in _split_list(text):
    if item not in cache:
      cache[item] = ir.Module.parse(f"module {{}} {item}").operation.location
    yield cache[item]


def restore(module, locations_b64: str | None):
  """Puts the locations of a call's `debug_locations` back on the module's
  operations and block arguments (nothing to do without one)."""
  if not locations_b64:
    return
  locs = list(_locations(locations_b64))
  items = list(_walk_located(module.operation))
  assert len(items) == len(locs), (len(items), len(locs))
  for item, loc in zip(items, locs):
    if isinstance(item, ir.Value):
      item.set_location(loc)
    else:
      item.location = loc


def frames_of(module) -> set:
  """Every user frame the locations of the module's operations name."""
  found = set()
  for item in _walk_located(module.operation):
    for m in _FRAME.finditer(str(item.location)):
      found.add((m.group("name"), m.group("file"), int(m.group("line"))))
  return found


def _entry(module):
  for op in module.body.operations:
    if op.operation.name == "func.func" and (
        "window_params" in op.attributes
        or "iteration_bounds" in op.attributes):
      return op
  return module.body.operations[0]


def _arg_name(arg) -> str | None:
  m = _NAME_ONLY.match(str(arg.location))
  return m.group(1) if m else None


def _ops(module) -> dict:
  """Per function, its non-constant operations in walk order (canonicalize
  hoists and merges constants in an order of its own)."""
  per_func = {}
  for fn in module.body.operations:
    name = ir.StringAttr(fn.attributes["sym_name"]).value
    per_func[name] = [
        (op.name, bool(_FRAME.search(str(op.location))))
        for op in _walk_located(fn.operation)
        if isinstance(op, ir.Operation) and op.name != "arith.constant"
        and op is not fn.operation]
  return per_func


def located(frames: set, canonical_module) -> Located:
  """The locations of a call: the frames its raw module names
  (`frames_of`), and the operations and arguments of the canonicalized
  module."""
  entry = _entry(canonical_module)
  return Located(frames,
                 [_arg_name(a) for a in entry.regions[0].blocks[0].arguments],
                 _ops(canonical_module))


# ------------------------------------------------------------ the checks

@functools.lru_cache(maxsize=None)
def _functions(path: str) -> tuple:
  """(name, first line, last line) of every function and lambda of a
  source file."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      found.append((node.name, node.lineno, node.end_lineno))
    elif isinstance(node, ast.Lambda):
      found.append(("<lambda>", node.lineno, node.end_lineno))
  return tuple(found)


def _defines(path: str, qualname: str | None, line: int) -> bool:
  """Whether `line` of `path` lies in a function named as the frame's
  qualified name ends (any function, for a frame without a name)."""
  short = qualname.rsplit(".", 1)[-1] if qualname else None
  return any(first <= line <= last and (short is None or short == name)
             for name, first, last in _functions(path))


def check_frames(loc: Located, sources) -> list[str]:
  """Problems with the user frames we name: each must be a line of a
  function of the kernel's source files `sources`."""
  sources = set(sources)
  return [f"location names {file}:{line} ({name}), not a line of the "
          f"kernel's source {sorted(sources)}"
          for name, file, line in sorted(loc.frames, key=str)
          if file not in sources or not _defines(file, name, line)]


def check_against(ours: Located, theirs: Located) -> list[str]:
  """Problems with where we locate what Pallas locates: its user-located
  operations must be user-located by us, and the ref arguments named the
  same. (Operations are paired per function in walk order, so this needs
  modules that compare equal.)"""
  problems = []
  if ours.arg_names != theirs.arg_names:
    problems.append(f"argument names {ours.arg_names} != "
                    f"Pallas's {theirs.arg_names}")
  for fn, their_ops in theirs.ops.items():
    our_ops = ours.ops.get(fn, [])
    if [n for n, _ in our_ops] != [n for n, _ in their_ops]:
      continue      # the modules differ; compare() reports that
    for k, ((op, ours_at), (_, theirs_at)) in enumerate(
        zip(our_ops, their_ops)):
      if theirs_at and not ours_at:
        problems.append(f"@{fn} operation {k} ({op}): Pallas locates it at "
                        "a user line, we do not")
  return problems
