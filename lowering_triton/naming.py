"""Readable names for the generated kernel: operand stems from the kernel
function's parameters (`x_ref` -> `x`), grid ids from the index maps'
arguments (`lambda i, j:` -> `i`, `j`)."""
from __future__ import annotations

import ast
import functools
import linecache

from jax import tree_util

from lowering_triton.codegen import Names


@functools.lru_cache(maxsize=256)
def _source_params(kernel_src: str) -> tuple[str, ...] | None:
  """Positional parameter names of the kernel function at `file:line`."""
  path, _, line = kernel_src.rpartition(":")
  if not line.isdigit() or not path:
    return None
  text = "".join(linecache.getlines(path))
  if not text:
    return None
  try:
    tree = ast.parse(text)
  except SyntaxError:
    return None
  line_no = int(line)
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      lines = {getattr(node, "lineno", -1)}
      lines |= {d.lineno for d in getattr(node, "decorator_list", [])}
      if line_no in lines:
        args = node.args
        return tuple(a.arg for a in args.posonlyargs + args.args)
  return None


def _jaxpr_location(spec) -> str:
  """`file:line` of the kernel function from the kernel jaxpr's debug info
  (for kernels passed as functools.partial, which have no code object)."""
  dbg = getattr(spec.jaxpr.jaxpr, "debug_info", None)
  info = getattr(dbg, "func_src_info", None) or ""
  _, _, loc = info.rpartition(" at ")
  return loc


def _stem(name: str) -> str:
  for suffix in ("_ref", "_refs", "_smem", "_vmem", "_hbm"):
    if name.endswith(suffix) and len(name) > len(suffix):
      return name[:-len(suffix)]
  return name


def _path_suffix(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
    parts.append(str(key))
  return "_".join(parts)


def operand_names(spec) -> list[str]:
  """A readable stem per kernel ref: prefetch, inputs, outputs, scratch."""
  gm = spec.grid_mapping
  _, pf, ins, outs, scr, _ = gm.split(range(gm.num_refs))
  fallback = ([f"prefetch{i}" for i in range(len(pf))] +
              [f"in{i}" for i in range(len(ins))] +
              [f"out{i}" for i in range(len(outs))] +
              [f"scratch{i}" for i in range(len(scr))])
  params = _source_params(spec.kernel_src)
  if not params:
    params = _source_params(_jaxpr_location(spec))
  if not params:
    return fallback
  try:
    args = gm.unflatten_kernel_refs(list(range(gm.num_refs)))
  except Exception:
    return fallback
  if len(params) < len(args):
    return fallback
  params = params[:len(args)]   # the rest are bound by functools.partial
  names = list(fallback)
  for pname, arg in zip(params, args):
    leaves = tree_util.tree_flatten_with_path(arg)[0]
    for path, leaf in leaves:
      if not isinstance(leaf, int):
        return fallback
      stem = _stem(pname)
      if len(leaves) > 1 or path:
        stem = f"{stem}_{_path_suffix(path)}" if path else stem
      names[leaf] = stem
  return names


def grid_names(spec, names: Names) -> list[str]:
  rank = len(spec.grid_mapping.grid)
  for bm in spec.grid_mapping.block_mappings:
    dbg = getattr(bm.index_map_jaxpr.jaxpr, "debug_info", None)
    arg_names = list(getattr(dbg, "arg_names", None) or ())[:rank]
    if len(arg_names) == rank and all(n and n.isidentifier() and
                                      not n.startswith("args")
                                      for n in arg_names) and \
        len(set(arg_names)) == rank:
      return [names.fresh(n) for n in arg_names]
  return [names.fresh(f"pid{d}") for d in range(rank)]
