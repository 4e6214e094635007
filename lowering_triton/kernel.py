"""From a `dsl.core.pallas_call.KernelSpec` to the source of one `@triton.jit`
function (plus its launch metadata): `generate(spec)`.

The generated module reads top to bottom like a hand-written kernel: a
header that says how the grid and every BlockSpec were mapped, the kernel
with the user's source lines as comments above the code they produced, and a
small launcher.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from typing import Any

import numpy as np

from dsl.core import checks, config
from dsl.core.blockspec import Element, element_padding, squeezed
from dsl.core.errors import BackendError
from dsl.core.gridspec import KernelArgs
from dsl.core.index_maps import reads_prefetch
from dsl.core.ranges import analyze_kernel
from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import CodeBuffer, Names, paren, sanitize
from lowering_triton.host import TritonHost
from lowering_triton.grid import GridPlan, plan_grid
from lowering_triton.launch_config import launch_config
from lowering_triton.naming import grid_names, operand_names
from lowering_triton.peel import peel
from lowering_triton.check_values import check_values_comment
from lowering_triton.kernel_refs import Axis, MemRef, as_sym, row_major_strides
from lowering_triton.rules import TABLE
from lowering_triton.values import TVal, literal_value, pow2
from lowering_triton.kernel_refs import ValueRef
from lowering_triton.rules.state import fresh_buffer
from lowering_triton.rules.dot import default_matmul_precision


@dataclasses.dataclass(frozen=True)
class KernelParam:
  """A pointer argument of the generated kernel."""
  name: str
  kind: str              # "prefetch", "input", "const" or "output"
  index: int             # position among the operands of its kind
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def signature(self) -> str:
    return "*" + dtypes.signature(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class GeneratedKernel:
  """The Triton source of one kernel and how to launch it."""
  name: str                       # the kernel's name (KernelSpec.name)
  fn_name: str                    # the @triton.jit function in `source`
  source: str
  params: tuple[KernelParam, ...]
  consts: tuple[np.ndarray, ...]  # arrays for the "const" params, in order
  grid: tuple[int, ...]
  grid_plan: GridPlan
  num_warps: int
  num_stages: int
  num_ctas: int
  enable_fp_fusion: bool
  debug: bool                     # compiled with device asserts
  aliases: tuple[tuple[int, int], ...]
  has_side_effects: bool
  where: str

  @property
  def launch_grid(self) -> tuple[int, int, int]:
    return self.grid_plan.launch

  @property
  def signature(self) -> dict[str, str]:
    return {p.name: p.signature for p in self.params}

  @functools.cached_property
  def digest(self) -> str:
    return hashlib.sha256(self.source.encode()).hexdigest()[:16]

  def __repr__(self):
    return (f"<GeneratedKernel {self.fn_name} grid={self.launch_grid} "
            f"num_warps={self.num_warps}>")


# ------------------------------------------------------------- generation

def _describe_block(bm, name: str) -> str:
  a = bm.array_aval
  if bm.whole_array:
    return f"{bm.origin} {name}: {a.str_short()}, whole array"
  dims = []
  for d in bm.block_shape:
    if d is squeezed:
      dims.append("None")
    elif isinstance(d, Element):
      dims.append(f"Element({d.block_size})")
    else:
      dims.append(str(d))
  block = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
  text = f"{bm.origin} {name}: {a.str_short()}, block {block}"
  notes, edges = [], []
  for d, n in zip(bm.block_shape, a.shape):
    if d is squeezed:
      continue
    b = d.block_size if isinstance(d, Element) else d
    if pow2(b) != b:
      notes.append(f"{b} padded to {pow2(b)} lanes")
    if isinstance(d, Element) or n % b:
      edges.append(str(n))
  if edges:
    notes.append(f"edge blocks masked at {' x '.join(edges)}")
  if notes:
    text += "; " + ", ".join(notes)
  return text


def _block_starts(lowering: TritonHost, bm, base: str, grid_ids, prefetch_refs):
  """Per array dim: the block's first element (a Sym), and for the dims
  whose block index is read from data, the condition that it lies inside
  the array (None for the others)."""
  a = bm.array_aval
  rank = len(a.shape)
  if bm.whole_array:
    return [0] * rank, [None] * rank, ()
  outs = lowering.lower_closed(bm.index_map_jaxpr,
                               list(grid_ids) + list(prefetch_refs))
  block = tuple(as_sym(o) for o in outs[:rank])
  from_data = reads_prefetch(bm.index_map_jaxpr, len(grid_ids))
  starts, inside = [], []
  for d, (dim, idx, n) in enumerate(zip(bm.block_shape, outs[:rank], a.shape)):
    size = 1 if dim is squeezed else (
        dim.block_size if isinstance(dim, Element) else int(dim))
    lo = dim.padding[0] if isinstance(dim, Element) else 0
    if idx.literal is not None:
      starts.append(int(idx.literal) * (1 if isinstance(dim, Element) else size)
                    - lo)
      inside.append(None)
      continue
    expr = idx.expr if idx.dtype == np.int32 else f"{paren(idx.expr)}.to(tl.int32)"
    word = "" if rank == 1 else str(d)
    if from_data and not isinstance(dim, Element):
      expr = lowering.bind_raw(expr, f"{base}_block{word}")
      inside.append(f"({expr} >= 0) & ({expr} < {-(-int(n) // size)})")
    else:
      inside.append(None)
    if not isinstance(dim, Element) and size != 1:
      expr = f"{expr} * {size}"
    if lo:
      expr = f"{expr} - {lo}"
    starts.append(lowering.bind_raw(expr, f"{base}_start{word}"))
  return starts, inside, block


def _check_blocks_inside(lowering: TritonHost, bm, inside, block) -> None:
  """With jax_pallas_enable_runtime_assert on, a block index read from data
  that lies outside the array fails a run-time check, worded as on every
  backend (the values come from the comment, see interpret_backend)."""
  conds = [c for c in inside if c is not None]
  if not conds or not config.enable_runtime_assert():
    return
  message = checks.block_index_message(
      bm.origin, "{block}", "{point}", bm.array_aval.str_short(),
      checks.block_limits_text(bm.array_aval.shape, bm.block_sizes,
                               element_padding(bm)),
      checks.index_map_at(bm))
  cond = " & ".join(f"({c})" for c in conds)
  message = checks.check_text(message, checks.index_map_at(bm))
  lowering.buf.line(f"tl.device_assert({cond}, {message!r})  "
                    + check_values_comment(lowering, (), block))
  lowering.uses_asserts = True
  lowering.has_side_effects = True


def _block_ref(lowering: TritonHost, bm, base: str, ptr: str, grid_ids,
               prefetch_refs) -> MemRef:
  a = bm.array_aval
  shape = tuple(int(n) for n in a.shape)
  wide = a.size * np.dtype(a.dtype).itemsize >= 2 ** 31
  starts, inside, block = _block_starts(lowering, bm, base, grid_ids,
                                        prefetch_refs)
  _check_blocks_inside(lowering, bm, inside, block)
  from_data = (not bm.whole_array
               and reads_prefetch(bm.index_map_jaxpr, len(grid_ids)))
  fixed, axes, upper, lower = [], [], [], []
  for d, (dim, n) in enumerate(zip(bm.block_shape, shape)):
    if bm.whole_array:
      axes.append(Axis(d, 0, 1, n))
      upper.append(False)
      lower.append(False)
      continue
    size = 1 if dim is squeezed else (
        dim.block_size if isinstance(dim, Element) else int(dim))
    is_elem = isinstance(dim, Element)
    dynamic = from_data and not isinstance(starts[d], int)
    # Element offsets read from data may point anywhere: mask by coordinate.
    upper.append(is_elem or n % size != 0 or (dynamic and dim is squeezed))
    lower.append((is_elem and (dim.padding[0] > 0 or dynamic)) or
                 (dynamic and dim is squeezed))
    if dim is squeezed:
      fixed.append(Axis(d, starts[d], 1, 1))
    else:
      # a block index times the block size (Element offsets: anything)
      axes.append(Axis(d, starts[d], 1, size, align=1 if is_elem else size))
  valid = tuple(c for c, dim in zip(inside, bm.block_shape)
                if c is not None and dim is not squeezed)
  return MemRef(base, ptr, np.dtype(a.dtype), shape, row_major_strides(shape),
                tuple(fixed), tuple(axes), tuple(upper), tuple(lower), wide,
                bm.origin, valid, block=block)


def _prefetch_ref(aval, base: str, ptr: str) -> MemRef:
  inner = getattr(aval, "inner_aval", aval)
  shape = tuple(int(n) for n in inner.shape)
  return MemRef(base, ptr, np.dtype(inner.dtype), shape,
                row_major_strides(shape), (),
                tuple(Axis(d, 0, 1, n) for d, n in enumerate(shape)),
                (False,) * len(shape), (False,) * len(shape), False,
                "scalar prefetch")


def _emit_program_ids(lowering: TritonHost, plan: GridPlan, ids: list[str]):
  """Binds the grid's program ids, each with its range stated to the
  compiler (`tl.assume(id < size)`: the launch grid is exact), which lets it
  prove index arithmetic free of overflow and loop trip counts positive."""
  buf = lowering.buf
  if not plan.parallel:
    return
  if not plan.flattened:
    for d in plan.parallel:
      buf.line(f"{ids[d]} = tl.program_id({plan.program_axis(d)})")
    for d in plan.parallel:
      buf.line(f"tl.assume({ids[d]} < {plan.grid[d]})")
    return
  pid = lowering.fresh("pid")
  buf.line(f"{pid} = tl.program_id(0)")
  buf.line(f"tl.assume({pid} < {plan.launch[0]})")
  sizes = [plan.grid[d] for d in plan.parallel]
  for k, d in enumerate(plan.parallel):
    inner = math.prod(sizes[k + 1:])
    expr = pid if inner == 1 else f"{pid} // {inner}"
    if k > 0:
      expr = f"({expr}) % {sizes[k]}" if inner != 1 else f"{pid} % {sizes[k]}"
    buf.line(f"{ids[d]} = {expr}")


def _pointer_params(gm, stems, names) -> tuple[list[KernelParam], KernelArgs]:
  """A pointer parameter per prefetch, input and output operand; their
  names by role."""
  stem_of = gm.split(stems)
  pf_avals = [getattr(a, "inner_aval", a) for a in gm.prefetch_avals]
  roles = (("prefetch", stem_of.prefetch, pf_avals),
           ("input", stem_of.inputs, [bm.array_aval for bm in gm.in_mappings]),
           ("output", stem_of.outputs,
            [bm.array_aval for bm in gm.out_mappings]))
  params, ptrs = [], {}
  for kind, role_stems, avals in roles:
    ptrs[kind] = []
    for k, (stem, aval) in enumerate(zip(role_stems, avals)):
      ptr = names.fresh(f"{stem}_ptr")
      ptrs[kind].append(ptr)
      params.append(KernelParam(ptr, kind, k, np.dtype(aval.dtype),
                                tuple(aval.shape)))
  return params, KernelArgs((), tuple(ptrs["prefetch"]),
                            tuple(ptrs["input"]), tuple(ptrs["output"]), ())


def _grid_id_values(plan: GridPlan, grid_ids, rank: int) -> list[Any]:
  """The value of each grid index: a program id or loop variable, or 0 for
  a dimension of size 1 that neither launches nor loops."""
  return [TVal(grid_ids[d], (), np.dtype(np.int32))
          if d in plan.parallel or d in plan.sequential
          else literal_value(0, np.int32) for d in range(rank)]


def _emit_kernel_body(lowering, spec, plan, stems, ptrs, grid_ids) -> None:
  """The grid (program ids, loops over the sequential dims) and the kernel
  body at every point of it."""
  gm, buf = spec.grid_mapping, lowering.buf
  _emit_program_ids(lowering, plan, grid_ids)
  id_vals = _grid_id_values(plan, grid_ids, len(gm.grid))
  stem_of = gm.split(stems)
  prefetch_refs = [_prefetch_ref(aval, stem, ptr) for aval, stem, ptr in
                   zip(gm.prefetch_avals, stem_of.prefetch, ptrs.prefetch)]
  scratch_refs = [_scratch(lowering, aval, stem, k) for k, (aval, stem) in
                  enumerate(zip(gm.scratch_avals, stem_of.scratch))]
  for ref, label in zip(scratch_refs, gm.split(spec.ref_labels()).scratch):
    ref.origin = label
  loops = list(plan.sequential)
  if loops:
    buf.comment("sequential grid dims run in order inside each program: "
                + ", ".join(f"{grid_ids[d]} < {gm.grid[d]}" for d in loops))
  _emit_steps(lowering, spec, gm, stems, ptrs, id_vals, prefetch_refs,
              scratch_refs, spec.jaxpr, loops)


def _refuse_pipeline_modes(spec) -> None:
  """A Triton program loads each of its blocks once: no pipeline runs
  between grid points for a BlockSpec's pipeline_mode to set (Pallas's
  Triton lowering refuses it too)."""
  for bm in spec.grid_mapping.block_mappings:
    if bm.pipeline_mode is not None:
      raise BackendError(
          spec.name, f"pipeline_mode={bm.pipeline_mode!r} has no effect on "
          f"the Triton backend: each program loads its block once, and no "
          f"pipeline runs between grid points; drop it (loops inside the "
          f"kernel are pipelined by dsl.triton.CompilerParams(num_stages=))",
          bm.where or spec.where, operand=bm.origin)


def _generate(spec, tensor_descriptors: bool = True) -> GeneratedKernel:
  gm = spec.grid_mapping
  _refuse_pipeline_modes(spec)
  try:
    plan = plan_grid(spec)
  except ValueError as e:
    raise BackendError(spec.name, str(e), spec.where) from e
  names = Names()
  fn_name = names.fresh(sanitize(spec.name))
  # Stems prefix generated names (x_ptr, x_offs); they are not names
  # themselves, so a loaded block can be called `x`.
  stems = _unique([sanitize(s) for s in operand_names(spec)])
  grid_ids = grid_names(spec, names)
  params, ptrs = _pointer_params(gm, stems, names)
  buf = CodeBuffer()
  num_warps, num_stages = launch_config(spec)
  lowering = TritonHost(spec.name, spec.where, names, buf, TABLE, spec.jaxpr,
                      analyze_kernel(spec))
  lowering.tensor_descriptors = tensor_descriptors
  lowering.num_warps = num_warps
  with buf.indent():
    _emit_kernel_body(lowering, spec, plan, stems, ptrs, grid_ids)
  lowering.drop_needless_barriers()
  buf.drop_unused_definitions()
  preamble = CodeBuffer()
  if lowering.descriptors:
    with preamble.indent():
      preamble.comment("tensor descriptors of the tiles loaded in loops "
                       "(TMA copies on sm_90)")
      for name, make in lowering.descriptors.values():
        preamble.line(f"{name} = {make}")

  # Assemble the module.
  const_params = []
  for k, (ptr, arr) in enumerate(lowering.const_buffers):
    const_params.append(KernelParam(ptr, "const", k, arr.dtype, arr.shape))
  ordered = ([p for p in params if p.kind in ("prefetch", "input")] +
             const_params + [p for p in params if p.kind == "output"])
  cp = spec.compiler_params
  num_ctas = getattr(cp, "num_ctas", None) or 1
  fp_fusion = getattr(cp, "enable_fp_fusion", True)
  if fp_fusion is None:
    fp_fusion = True
  source = _module_source(spec, gm, plan, fn_name, ordered, stems, grid_ids,
                          buf, lowering, num_warps, num_stages, preamble)
  return GeneratedKernel(
      name=spec.name, fn_name=fn_name, source=source, params=tuple(ordered),
      consts=tuple(arr for _, arr in lowering.const_buffers),
      grid=tuple(gm.grid), grid_plan=plan, num_warps=int(num_warps),
      num_stages=int(num_stages), num_ctas=int(num_ctas),
      enable_fp_fusion=bool(fp_fusion), debug=lowering.uses_asserts,
      aliases=tuple(spec.input_output_aliases),
      has_side_effects=lowering.has_side_effects, where=spec.where)


def _unique(stems: list[str]) -> list[str]:
  seen: dict[str, int] = {}
  out = []
  for s in stems:
    if s in seen:
      seen[s] += 1
      s = f"{s}{seen[s]}"
    seen.setdefault(s, 0)
    out.append(s)
  return out


def _scratch(lowering: TritonHost, aval, stem: str, k: int):
  inner = getattr(aval, "inner_aval", aval)
  space = str(getattr(aval, "memory_space", "") or "")
  if space.startswith("semaphore"):
    raise lowering.error(f"scratch_shapes[{k}] is a semaphore, which the "
                         "Triton backend does not support")
  shape = tuple(int(d) for d in inner.shape)
  dtype = np.dtype(inner.dtype)
  lowering.buf.comment(f"scratch_shapes[{k}] {stem}: {dtype.name}{list(shape)}"
                       ", held in registers for the whole program")
  name = lowering.bind_raw(fresh_buffer(shape, dtype), stem, pure=False)
  return ValueRef(name, shape, dtype, f"scratch_shapes[{k}]")


def _emit_steps(lowering, spec, gm, stems, ptrs, id_vals, prefetch_refs,
                scratch_refs, jaxpr, loops):
  """Emits a `for` per sequential grid dim in `loops` (recursively) and the
  body of one step.

  Around the innermost loop, the step's `pl.when(j == 0)` blocks run before
  it and its `pl.when(j == last)` blocks after it (see `peel`).
  """
  buf = lowering.buf
  header = lambda d: f"for {id_vals[d].expr} in tl.range(0, {gm.grid[d]}):"
  if len(loops) > 1:
    with buf.indent(header(loops[0])), lowering.in_loop():
      lowering.reset_comments()
      _emit_steps(lowering, spec, gm, stems, ptrs, id_vals, prefetch_refs,
                  scratch_refs, jaxpr, loops[1:])
    return
  emit = functools.partial(_emit_step, lowering, spec, gm, stems, ptrs,
                           prefetch_refs=prefetch_refs,
                           scratch_refs=scratch_refs)
  if not loops:
    emit(id_vals, jaxpr.jaxpr, jaxpr.consts)
    return
  (d,) = loops
  trip = int(gm.grid[d])
  parts = peel(jaxpr.jaxpr, jaxpr.jaxpr.invars[d], trip)
  name = id_vals[d].expr
  at = lambda k: [literal_value(k, np.int32) if i == d else v
                  for i, v in enumerate(id_vals)]
  if parts.prologue is not None:
    buf.comment(f"first step ({name} = 0), peeled out of the loop")
    emit(at(0), parts.prologue, jaxpr.consts, describe=False)
    lowering.barrier("the loop may read these stores")
  with buf.indent(header(d)), lowering.in_loop():
    lowering.reset_comments()
    emit(id_vals, parts.body, jaxpr.consts)
    lowering.barrier("the next grid step may read this step's stores")
  if parts.epilogue is not None:
    buf.comment(f"last step ({name} = {trip - 1}), peeled out of the loop")
    emit(at(trip - 1), parts.epilogue, jaxpr.consts, describe=False)


def _emit_step(lowering, spec, gm, stems, ptrs, id_vals, jaxpr, consts, *,
               prefetch_refs, scratch_refs, describe=True):
  """Emits the block refs at grid point `id_vals` and `jaxpr` on them."""
  buf = lowering.buf
  lowering.grid_point = tuple(as_sym(v) for v in id_vals)
  stem_of, label_of = gm.split(stems), gm.split(spec.ref_labels())
  block_refs = []
  for bm, stem, ptr, label in zip(gm.block_mappings,
                                  stem_of.inputs + stem_of.outputs,
                                  ptrs.inputs + ptrs.outputs,
                                  label_of.inputs + label_of.outputs):
    if describe:
      buf.comment(_describe_block(bm, stem))
    block_refs.append(dataclasses.replace(
        _block_ref(lowering, bm, stem, ptr, id_vals, prefetch_refs),
        origin=label))
  if describe:
    buf.comment(f"kernel body ({spec.kernel_src})")
  lowering.reset_comments()
  args = id_vals + prefetch_refs + block_refs + scratch_refs
  lowering.lower_jaxpr(jaxpr, consts, args)


def _module_source(spec, gm, plan: GridPlan, fn_name: str, params, stems,
                   grid_ids, body: CodeBuffer, lowering: TritonHost,
                   num_warps: int, num_stages: int,
                   preamble: CodeBuffer) -> str:
  out = CodeBuffer()
  out.comment(f"Triton kernel generated by lowering_triton from kernel "
              f"'{spec.name}'")
  out.comment(f"  defined at {spec.kernel_src}, called at {spec.where}")
  grid_desc = []
  for d, size in enumerate(gm.grid):
    axis = plan.program_axis(d)
    if d in plan.sequential:
      grid_desc.append(f"{grid_ids[d]} < {size}: loop inside each program")
    elif axis is not None:
      grid_desc.append(f"{grid_ids[d]} < {size}: tl.program_id({axis})")
    elif d in plan.parallel:
      grid_desc.append(f"{grid_ids[d]} < {size}: flattened into "
                       "tl.program_id(0)")
    else:
      grid_desc.append(f"{grid_ids[d]} = 0")
  out.comment(f"grid {tuple(gm.grid)}" + (": " + "; ".join(grid_desc)
                                          if grid_desc else ""))
  out.comment(f"launch grid {plan.launch}, num_warps={num_warps}, "
              f"num_stages={num_stages}")
  out.line("import triton")
  out.line("import triton.language as tl")
  out.line()
  for src in lowering.helpers.values():
    out.line()
    out.line(src)
    out.line()
  out.line()
  out.line("@triton.jit")
  out.line(f"def {fn_name}({', '.join(p.name for p in params)}):")
  text = out.getvalue() + preamble.getvalue() + body.getvalue()
  tail = CodeBuffer()
  tail.line()
  tail.line()
  tail.line(f"GRID = {plan.launch}")
  tail.line(f"NUM_WARPS = {num_warps}")
  tail.line(f"NUM_STAGES = {num_stages}")
  tail.line()
  tail.line()
  args = [p.name[:-4] if p.name.endswith("_ptr") else p.name for p in params]
  with tail.indent(f"def launch({', '.join(args)}):"):
    tail.line('"""Launches the kernel on buffers that have a data_ptr() (such '
              'as torch tensors).')
    tail.line('"""')
    tail.line(f"{fn_name}[GRID]({', '.join(args)}, num_warps=NUM_WARPS, "
              "num_stages=NUM_STAGES)")
  return text + tail.getvalue()


@functools.lru_cache(maxsize=512)
def _generate_cached(spec, runtime_asserts: bool, matmul_precision: str,
                     poison_buffers: bool,
                     tensor_descriptors: bool) -> GeneratedKernel:
  # Cache key parts: they change the code.
  del runtime_asserts, matmul_precision, poison_buffers
  return _generate(spec, tensor_descriptors)


def generate(spec, tensor_descriptors: bool | None = None) -> GeneratedKernel:
  """The Triton source and launch metadata of `spec` (cached per spec);
  `tensor_descriptors` (default: jax_pallas_triton_tensor_descriptors)
  loads whole aligned tiles in loops through TMA descriptors (tma.py)."""
  if tensor_descriptors is None:
    tensor_descriptors = config.triton_tensor_descriptors()
  key = (config.enable_runtime_assert(), default_matmul_precision(),
         config.poison_buffers(), bool(tensor_descriptors))
  fresh = _generate_cached.cache_info().misses
  gk = _generate_cached(spec, *key)
  if spec.debug and _generate_cached.cache_info().misses > fresh:
    print(f"--- Triton source of kernel {spec.name} ({spec.kernel_src})\n"
          f"{gk.source}")
  dump_dir = config.dump_triton_to()
  if dump_dir:
    dump(gk, dump_dir)
  return gk


def dump(gk: GeneratedKernel, directory: str) -> str:
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{gk.fn_name}_{gk.digest[:8]}.py")
  if not os.path.exists(path):
    with open(path, "w") as f:
      f.write(gk.source)
  return path
