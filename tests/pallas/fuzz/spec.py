"""A fuzz case as data: operands, how they are blocked over the grid, and
the numpy helpers that read and write blocks for the reference.

An operand's `dims` say, per array dim, how the block is cut (`blocked`,
`squeezed`, `element`) and where its block index comes from (`src`):

- `axis`: the grid index of `axis`;
- `rev`: the grid index of `axis` counted from the end;
- `pf`: the scalar-prefetch table entry at the grid index of `axis`;
- `const`: the fixed block index `axis`.

An `element` dim's index map returns an element offset: index * `step`.
`dims=None` means no blocking: the kernel sees the whole array.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "int8", "uint8")
DTYPES = FLOATS + INTS + ("bool",)


def is_float(dtype: str) -> bool:
  return dtype in FLOATS


def is_int(dtype: str) -> bool:
  return dtype in INTS


@dataclasses.dataclass(frozen=True)
class Dim:
  """How one array dim is blocked and where its block index comes from."""
  kind: str          # "blocked" | "squeezed" | "element"
  size: int          # block size (1 when squeezed)
  src: str = "axis"  # "axis" | "rev" | "pf" | "const"
  axis: int = 0      # the grid axis, or the block index when src == "const"
  step: int = 0      # element dims: offset = index * step

  def __str__(self):
    where = {"axis": f"g{self.axis}", "rev": f"rev(g{self.axis})",
             "pf": f"pf[g{self.axis}]", "const": f"{self.axis}"}[self.src]
    cut = {"blocked": f"{self.size}", "squeezed": "None",
           "element": f"Element({self.size})*{self.step}"}[self.kind]
    return f"{cut}@{where}"


@dataclasses.dataclass(frozen=True)
class Operand:
  """An input, output or scratch array and how the kernel sees it."""
  shape: tuple[int, ...]
  dtype: str
  dims: tuple[Dim, ...] | None = None  # None: the whole array
  space: str = "block"                 # "block" | "any" (memory_space=ANY)
  #   | "smem" (a scalar-prefetch-like table in SMEM) | "scalar" (a Python
  #   scalar operand, weakly typed)
  nan: bool = False                    # inputs: a few NaNs among the values
  special: bool = False                # inputs: inf, -inf, NaN, -0.0 and
  #   the largest values whose products an f32 accumulator holds

  @property
  def kshape(self) -> tuple[int, ...]:
    """The shape of the ref the kernel sees."""
    if self.dims is None:
      return self.shape
    return tuple(d.size for d in self.dims if d.kind != "squeezed")

  def __str__(self):
    cut = "whole" if self.dims is None else \
        "(" + ", ".join(str(d) for d in self.dims) + ")"
    extra = (f" {self.space.upper()}" if self.space != "block" else "") + (
        " nan" if self.nan else "") + (" special" if self.special else "")
    return f"{self.dtype}{list(self.shape)} {cut}{extra}"


@dataclasses.dataclass(frozen=True)
class Case:
  """One generated kernel: its family, operands, grid and body parameters.

  `body` holds the family's own parameters (expressions, flags) as a tuple of
  (name, value) pairs so that the case stays hashable and printable.
  """
  seed: int
  index: int
  family: str
  grid: tuple[int, ...]
  inputs: tuple[Operand, ...]
  outputs: tuple[Operand, ...]
  body: tuple[tuple[str, Any], ...] = ()
  prefetch: tuple[int, ...] | None = None   # the scalar-prefetch table
  semantics: tuple[str, ...] | None = None  # dimension_semantics, if given
  aliases: tuple[tuple[int, int], ...] = ()
  features: frozenset[str] = frozenset()

  @property
  def name(self) -> str:
    return f"fuzz_{self.family}_{self.seed}_{self.index}"

  @property
  def id(self) -> str:
    return f"{self.seed}:{self.index}"

  def param(self, key, default=None):
    return dict(self.body).get(key, default)

  def describe(self) -> str:
    rows = [f"case {self.id} ({self.family}) grid={self.grid}"
            + (f" prefetch={list(self.prefetch)}" if self.prefetch else "")
            + (f" semantics={self.semantics}" if self.semantics else "")
            + (f" aliases={self.aliases}" if self.aliases else "")]
    rows += [f"  in{k}: {op}" for k, op in enumerate(self.inputs)]
    rows += [f"  out{k}: {op}" for k, op in enumerate(self.outputs)]
    rows += [f"  {k}: {_show(v)}" for k, v in self.body]
    rows.append(f"  features: {', '.join(sorted(self.features))}")
    return "\n".join(rows)


def _show(value) -> str:
  if isinstance(value, tuple) and value and all(hasattr(v, "walk")
                                                for v in value):
    return "(" + ", ".join(str(v) for v in value) + ")"
  return str(value)


# ---- index maps, shared by the kernel's BlockSpecs, the kernel body (to mask
# padding) and the reference. `ids` are ints or traced scalars; `pf` is the
# prefetch table (numpy array or ref).

def block_index(dim: Dim, ids, grid, pf):
  if dim.src == "axis":
    return ids[dim.axis]
  if dim.src == "rev":
    return grid[dim.axis] - 1 - ids[dim.axis]
  if dim.src == "pf":
    return pf[ids[dim.axis]]
  return dim.axis


def index_map_fn(op: Operand, grid):
  """The BlockSpec index map: grid ids (+ prefetch ref) -> block indices."""
  def index_map(*args):
    ids, pf = args[:len(grid)], (args[len(grid)] if len(args) > len(grid)
                                 else None)
    out = []
    for d in op.dims:
      b = block_index(d, ids, grid, pf)
      out.append(b * d.step if d.kind == "element" else b)
    return tuple(out)
  return index_map


def starts(op: Operand, ids, grid, pf) -> list:
  """The first element of the block along each array dim."""
  if op.dims is None:
    return [0] * len(op.shape)
  out = []
  for d in op.dims:
    b = block_index(d, ids, grid, pf)
    out.append(b * (d.step if d.kind == "element" else d.size))
  return out


def valid_mask(op: Operand, ids, grid, pf, xp=jnp):
  """bool[kshape]: True where the block lies inside the array."""
  from tests.pallas.fuzz.expr import iota
  mask = xp.ones(op.kshape, bool)
  if op.dims is None:
    return mask
  first = starts(op, ids, grid, pf)
  k = 0
  for d, s, n in zip(op.dims, first, op.shape):
    if d.kind == "squeezed":
      continue
    mask = mask & (iota(xp, op.kshape, k) + s < n)
    k += 1
  return mask


def fill_value(dtype: str):
  """What masked-off (padding) elements are replaced by."""
  return {"bool": False}.get(dtype, 1)


def sanitize(x, op: Operand, ids, grid, pf, fill=None, xp=jnp):
  """`x` (a block of `op`) with the part past the array set to `fill`."""
  if op.dims is None:
    return x
  fill = fill_value(op.dtype) if fill is None else fill
  return xp.where(valid_mask(op, ids, grid, pf, xp), x,
                  xp.asarray(fill, x.dtype))


def np_valid(op: Operand, ids, grid, pf) -> np.ndarray:
  """valid_mask for int grid ids, in numpy (for the generator)."""
  if op.dims is None:
    return np.ones(op.kshape, bool)
  first = starts(op, ids, grid, pf)
  axes = [np.arange(d.size) + int(s) < n for d, s, n in
          zip(op.dims, first, op.shape) if d.kind != "squeezed"]
  mask = np.ones(op.kshape, bool)
  for k, ax in enumerate(axes):
    shape = [1] * len(axes)
    shape[k] = len(ax)
    mask = mask & ax.reshape(shape)
  return mask


# ---- numpy blocks for the reference

def poison(dtype: str):
  """What memory nobody defined holds on every backend (docs/interpret.md,
  "Semantics"): NaN, the signed minimum plus one, the unsigned maximum,
  True. (Pallas's interpret mode holds the minimum for integers.)"""
  if is_float(dtype):
    return np.nan
  if dtype == "bool":
    return True
  info = np.iinfo(np.dtype(dtype))
  return int(info.max) if info.min == 0 else int(info.min) + 1


def _windows(op: Operand, ids, grid, pf):
  first = starts(op, ids, grid, pf)
  sizes = op.shape if op.dims is None else [d.size for d in op.dims]
  return [(int(s), int(z)) for s, z in zip(first, sizes)]


def read_block(arr: np.ndarray, op: Operand, ids, grid, pf) -> np.ndarray:
  """The block the kernel sees at grid point `ids`; padding is poison."""
  win = _windows(op, ids, grid, pf)
  block = np.full([z for _, z in win], poison(op.dtype), arr.dtype)
  src = tuple(slice(s, min(s + z, n)) for (s, z), n in zip(win, arr.shape))
  dst = tuple(slice(0, min(s + z, n) - s) for (s, z), n in zip(win, arr.shape))
  block[dst] = arr[src]
  return block.reshape(op.kshape)


def write_block(arr: np.ndarray, op: Operand, ids, grid, pf, value) -> None:
  """Writes `value` (kshape) to the block at `ids`, dropping the padding."""
  win = _windows(op, ids, grid, pf)
  value = np.asarray(value).astype(arr.dtype).reshape([z for _, z in win])
  src = tuple(slice(0, min(s + z, n) - s) for (s, z), n in zip(win, arr.shape))
  dst = tuple(slice(s, min(s + z, n)) for (s, z), n in zip(win, arr.shape))
  arr[dst] = value[src]


def grid_points(grid):
  """Grid points in the order a sequential run visits them (row-major)."""
  return list(np.ndindex(*grid)) if grid else [()]


# ---- input data

def make_input(rng: np.random.Generator, op: Operand, n: int = 0):
  """Random data for input `op`; `n`: the size of the output an array of
  indices (`space="index"`) points into."""
  if op.space == "scalar":        # a Python scalar operand
    if op.dtype == "int32":
      return int(rng.integers(0, 7))
    return float(rng.choice([0.5, -1.5, 2.0, 3.0]))
  if op.space == "index":         # repeats, and a few outside [0, n)
    idx = rng.integers(0, n, op.shape)
    idx[rng.random(op.shape) < 0.3] = rng.integers(0, 2)
    out = rng.random(op.shape) < 0.08
    idx[out] = rng.choice([-1, n, n + 5, -(n + 3)], int(out.sum()))
    return idx.astype(np.int32)
  dt = np.dtype(jnp.dtype(op.dtype))
  if op.dtype == "bool":
    return rng.integers(0, 2, op.shape).astype(bool)
  if op.dtype == "uint8":
    return rng.integers(0, 40, op.shape).astype(dt)
  if op.dtype == "int8":
    return rng.integers(-20, 21, op.shape).astype(dt)
  if op.dtype == "int32":
    return rng.integers(-100, 101, op.shape).astype(dt)
  x = (rng.standard_normal(op.shape) * 2).astype(np.float32)
  if op.nan and x.size:
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, max(1, flat.size // 16))] = np.nan
  if op.special and x.size:
    # f16's largest value squared fits f32; bf16's would overflow the
    # accumulator, where sums of +inf and -inf depend on the order
    big = 65504.0 if op.dtype == "float16" else 2.0 ** 40
    flat = x.reshape(-1)
    for v in (np.inf, -np.inf, np.nan, -0.0, big, -big):
      flat[rng.integers(0, flat.size, max(1, flat.size // 32))] = v
  return x.astype(dt)


def make_inputs(case: Case) -> list:
  rng = np.random.default_rng([case.seed, case.index, 7])
  return [make_input(rng, op, case.param("n", 0)) for op in case.inputs]
