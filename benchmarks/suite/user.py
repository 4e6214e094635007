"""A user's own kernel in the benchmark table (`--kernel module:function`).

    python -m benchmarks --kernel mypkg.mymod:fn --inputs "f32[4096,1024]" \\
        [--reference mypkg.mymod:ref] [--config block=256]

The function is called on random inputs of the `--inputs` shapes and dtypes
(normal floats; zeros for integers and booleans; `:LOW..HIGH` draws uniform
values from LOW up to HIGH, `:sorted` sorts them: `i32[4096]:0..1000`,
`i32[65]:0..4096:sorted`), with the `--config` items as keyword arguments. How it is called decides which columns it gets:

* it has a parameter named `pl`: it is written against a Pallas-like module
  and called as `fn(*inputs, pl=<module>)`, once with `dsl` (its
  `pl.pallas_call` bound to the row's backend) and once with
  `jax.experimental.pallas` (interpret mode on CPUs) for the Pallas column;
* else, with a `backend` parameter: `fn(*inputs, backend=<row backend>)`;
* else: `fn(*inputs)`, on the platform's default backend only.

`--reference` names a plain-jnp function of the same inputs: XLA runs it as
the XLA column, and the outputs are checked against it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp

from benchmarks.usage_errors import UsageError
from dsl.tools import targets
from benchmarks.suite.base import KernelBench

_DTYPES = {"f64": "float64", "f32": "float32", "f16": "float16",
           "bf16": "bfloat16", "i64": "int64", "i32": "int32",
           "i16": "int16", "i8": "int8", "u32": "uint32", "u16": "uint16",
           "u8": "uint8", "bool": "bool", "pred": "bool"}
_SHAPE = re.compile(r"\s*([A-Za-z][A-Za-z0-9_]*)\[([\d,\s]*)\]"
                    r"((?::[^,;:\s]+)*)\s*(?:[,;]|$)")
_NUMBER = r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
_RANGE = re.compile(rf"({_NUMBER})\.\.({_NUMBER})")


@dataclasses.dataclass(frozen=True)
class Fill:
  """How the values of one `--inputs` array are made: `low..high` (uniform;
  integers from `low` up to `high`, excluded) or None (normal floats, zero
  integers), sorted ascending or not."""
  low: float | None = None
  high: float | None = None
  sorted: bool = False

  def values(self, key, spec: jax.ShapeDtypeStruct):
    dtype, n = jnp.dtype(spec.dtype), math.prod(spec.shape)
    low, high = self.low, self.high
    if jnp.issubdtype(dtype, jnp.inexact):
      if low is None:
        x = jax.random.normal(key, spec.shape, jnp.float32)
      else:
        x = jax.random.uniform(key, spec.shape, jnp.float32, low, high)
    else:
      if low is None and self.sorted:    # offsets into n elements: 0..n
        low, high = 0, n + 1
      if low is None:
        return jnp.zeros(spec.shape, dtype)
      x = jax.random.randint(key, spec.shape, int(low), int(high),
                             jnp.int64 if jax.config.jax_enable_x64
                             else jnp.int32)
    if self.sorted:
      x = jnp.sort(x.reshape(-1)).reshape(spec.shape)
    return x.astype(dtype)


def _fill(text: str, modifiers: str, dtype) -> Fill:
  """The Fill of one input from its `:modifier`s (`:0..1000`, `:sorted`)."""
  low = high = None
  is_sorted = False
  for item in modifiers.split(":")[1:]:
    m = _RANGE.fullmatch(item)
    if item == "sorted":
      is_sorted = True
    elif m:
      low, high = float(m.group(1)), float(m.group(2))
    else:
      raise UsageError(f"unknown --inputs modifier {item!r} in {text!r}: use "
                       "a range LOW..HIGH (e.g. i32[4096]:0..1000, labels "
                       "below 1000) or 'sorted' (e.g. i32[65]:0..4096:sorted,"
                       " ascending offsets)")
  if low is not None:
    integer = not jnp.issubdtype(dtype, jnp.inexact)
    if integer and not (low.is_integer() and high.is_integer()):
      raise UsageError(f"--inputs {text!r}: an integer range takes integers")
    if not low < high:
      raise UsageError(f"--inputs {text!r}: the range {low:g}..{high:g} is "
                       "empty (LOW..HIGH: LOW included, HIGH not)")
    if integer and dtype != jnp.bool_:
      info = jnp.iinfo(dtype)
      if low < info.min or high - 1 > info.max:
        raise UsageError(f"--inputs {text!r}: {low:g}..{high:g} does not fit "
                         f"{dtype} ({info.min}..{info.max + 1})")
  return Fill(low, high, is_sorted)


def parse_input_specs(text: str) -> list[tuple[jax.ShapeDtypeStruct, Fill]]:
  """'f32[4096,1024], i32[4096]:0..1000' -> (shape and dtype, Fill) each."""
  out, pos = [], 0
  text = text.strip()
  while pos < len(text):
    m = _SHAPE.match(text, pos)
    if not m:
      raise UsageError(f"malformed --inputs {text!r} at {text[pos:]!r}: "
                       "expected shapes like f32[4096,1024], comma-separated")
    name = _DTYPES.get(m.group(1).lower(), m.group(1).lower())
    try:
      dtype = jnp.dtype(name)
    except TypeError:
      raise UsageError(f"unknown dtype {m.group(1)!r} in --inputs; use one of "
                       f"{', '.join(_DTYPES)}") from None
    dims = [d for d in m.group(2).replace(" ", "").split(",") if d]
    spec = jax.ShapeDtypeStruct(tuple(int(d) for d in dims), dtype)
    out.append((spec, _fill(m.group(0).strip(" ,;"), m.group(3), dtype)))
    pos = m.end()
  if not out:
    raise UsageError("--inputs is empty: give e.g. --inputs 'f32[4096,1024]'")
  return out


def parse_inputs(text: str) -> list[jax.ShapeDtypeStruct]:
  """'f32[4096,1024], f32[1024]' -> two ShapeDtypeStructs."""
  return [spec for spec, _ in parse_input_specs(text)]


def load_function(target: str, flag: str):
  """'pkg.mod:fn' or 'path/to/file.py:fn' -> the function."""
  try:
    return targets.load_function(target)
  except targets.TargetError as e:
    raise UsageError(f"{flag} {e}") from None


class _BoundPl:
  """A `pl` module whose `pallas_call` has the row's keywords (backend=...,
  interpret=True, compiler_params=...) filled in."""

  def __init__(self, module, call_kw):
    self._module = module
    self.pallas_call = functools.partial(module.pallas_call, **call_kw)

  def __getattr__(self, name):
    return getattr(self._module, name)


def _parameters(fn) -> dict:
  try:
    return dict(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return {}


class UserKernel(KernelBench):
  source = "user"
  tunable = False
  pallas_note = "n/a: no 'pl' parameter"
  bound = "memory"

  def __init__(self, target: str, fn, inputs, reference=None,
               reference_name: str | None = None, fills=None):
    self.name = target
    self.fn = fn
    self.specs = list(inputs)
    self.fills = list(fills or [Fill()] * len(self.specs))
    self.reference_fn = reference
    params = _parameters(fn)
    self.takes_pl = "pl" in params
    self.takes_any_keyword = any(p.kind is p.VAR_KEYWORD
                                 for p in params.values())
    self.takes_backend = "backend" in params or self.takes_any_keyword
    self.pallas_source = self.takes_pl
    self.summary = f"user kernel {target}" + (
        f" (reference {reference_name})" if reference_name else "")
    self.size = self.specs[0].shape
    self._out_bytes = None

  def keywords(self) -> set[str]:
    params = _parameters(self.fn)
    return {n for n, p in params.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is not p.empty and n not in ("pl", "backend")}

  def backend_choice(self) -> bool:
    return self.takes_pl or self.takes_backend

  # --- data
  def normalize(self, dims):
    return tuple(dims)

  def default_sizes(self, platform):
    return [self.size]

  def inputs(self, size, dtype):
    keys = jax.random.split(jax.random.key(0), len(self.specs))
    return tuple(f.values(k, s)
                 for k, s, f in zip(keys, self.specs, self.fills))

  @property
  def reference(self):
    return self.reference_fn

  # --- kernel
  def build(self, pl, size, dtype, config, **call_kw):
    fn, kw = self.fn, dict(config)
    if self.takes_pl:
      kw["pl"] = _BoundPl(pl, call_kw)
    elif self.takes_backend and "backend" in call_kw:
      kw["backend"] = call_kw["backend"]
    return lambda *xs: fn(*xs, **kw)

  # --- accounting
  def io_bytes(self, size, dtype):
    if self._out_bytes is None:
      import dsl
      try:
        outs = jax.eval_shape(self.build(dsl, size, dtype, {}), *self.specs)
        self._out_bytes = sum(math.prod(o.shape) * o.dtype.itemsize
                              for o in jax.tree_util.tree_leaves(outs))
      except Exception:  # accounting only: count the inputs alone
        self._out_bytes = 0
    return float(sum(math.prod(s.shape) * s.dtype.itemsize
                     for s in self.specs) + self._out_bytes)

  def tolerance(self, dtype):
    return super().tolerance(self.specs[0].dtype)


def check_arity(fn, n: int, flag: str, target: str) -> None:
  """A usage error when `fn` cannot take `n` positional arrays."""
  params = [p for name, p in _parameters(fn).items()
            if name not in ("pl", "backend")]
  if any(p.kind is p.VAR_POSITIONAL for p in params):
    return
  positional = [p for p in params
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  required = [p for p in positional if p.default is p.empty]
  if not len(required) <= n <= len(positional):
    names = ", ".join(p.name for p in positional) or "none"
    raise UsageError(
        f"--inputs gives {n} array{'s' * (n != 1)} but {flag} {target} takes "
        f"{len(required)}" + (f" to {len(positional)}" if len(positional) !=
                              len(required) else "")
        + f" positional argument{'s' * (len(positional) != 1)} ({names})")


def load_user_kernel(target: str, inputs: str, reference: str | None):
  fn = load_function(target, "--kernel")
  ref = load_function(reference, "--reference") if reference else None
  specs, fills = zip(*parse_input_specs(inputs))
  check_arity(fn, len(specs), "--kernel", target)
  if ref is not None:
    check_arity(ref, len(specs), "--reference", reference)
  return UserKernel(target, fn, specs, ref, reference, fills)

