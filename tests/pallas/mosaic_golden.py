"""Compare our "mosaic" backend with JAX's own Pallas TPU lowering.

Both lower on a CPU: `jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))`
gives StableHLO with one `stablehlo.custom_call @tpu_custom_call` per kernel,
whose `backend_config` (JSON) holds the Mosaic module as base64 MLIR bytecode.
`decode` turns that back into a module with jaxlib's `mosaic-serde` pass (the
inverse of what `lower_module_to_custom_call` applied) and normalizes it with
upstream `canonicalize` and `cse`; `normalize_text` then removes only the
differences docs/mosaic.md lists as harmless:

- SSA value names (the printer numbers values in order, so equal structure
  prints equal names) and locations (printed without debug info; jax 0.12's
  `debug_locations` config field is left out of the config compared);
- the order of the functions after the entry function (sorted by name);
- symbol visibility (`private` on the index-map functions);
- the order of the constants that `canonicalize` hoists to the top of a
  function (in first-use order): they are sorted and renamed after their
  value and type.

Locations are not part of the module comparison: ours are not Pallas's
(docs/mosaic.md, "Locations"), and mosaic_locations.py checks them on their
own (`Call.located`, `compare(..., sources=...)`).

`Call` keeps, per custom call, the decoded module text, the call's JSON
config without the body and the debug locations, its own attributes, and
what mosaic_locations.py checks of its locations.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import difflib
import json
import re

import jax
from dsl.core.jax_internals import ir, passmanager, tpu as tpu_lib
from jax.interpreters import mlir as jax_mlir

from tests.pallas import mosaic_locations as locations

NORMALIZE = "builtin.module(mosaic-serde{serialize=false},canonicalize,cse)"

# Custom call attributes compared as text (the operands' layouts follow from
# the shapes; backend_config is decoded separately).
CALL_ATTRS = ("kernel_name", "has_side_effect", "output_operand_aliases",
              "mhlo.frontend_attributes", "operand_layouts", "result_layouts")


@dataclasses.dataclass
class Call:
  module: str                 # normalized module text
  located: locations.Located  # its locations (mosaic_locations.py)
  config: dict                # backend_config without body, debug_locations
  attrs: dict                 # CALL_ATTRS present on the custom call


def _context() -> ir.Context:
  ctx = jax_mlir.make_ir_context()
  tpu_lib.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True     # the serialized stable_mosaic.*
  return ctx


def decode_call(body_b64: str, locations_b64: str | None = None):
  """(normalized module text, its locations) of a backend_config body: the
  module deserialized and canonicalized, printed without locations; the
  locations as mosaic_locations.py reads them (with the call's
  `debug_locations` put back on the operations where it has them)."""
  ctx = _context()
  with ctx, ir.Location.unknown():
    module = ir.Module.parse(base64.b64decode(body_b64))
    locations.restore(module, locations_b64)
    frames = locations.frames_of(module)      # of every raw operation
    passmanager.PassManager.parse(NORMALIZE).run(module.operation)
    assert module.operation.verify()
    text = normalize_text(module.operation.get_asm())
    return text, locations.located(frames, module)


def decode(body_b64: str) -> str:
  """The module in a backend_config body, deserialized and canonicalized,
  as normalized text."""
  return decode_call(body_b64)[0]


_FUNC = re.compile(r"^  func\.func ", re.M)
_CONST = re.compile(r"^    (%[\w$.-]+) = (arith\.constant .*)$")


def _sort_constants(func_text: str) -> str:
  """Sorts the hoisted constants of one function and names them K0, K1, ...
  in that order."""
  lines = func_text.split("\n")
  consts = [(k, m) for k, line in enumerate(lines)
            if (m := _CONST.match(line))]
  if not consts:
    return func_text
  ordered = sorted(consts, key=lambda km: km[1].group(2))
  names = {m.group(1): f"%K{i}" for i, (_, m) in enumerate(ordered)}
  slots = [k for k, _ in consts]
  for slot, (_, m) in zip(slots, ordered):
    lines[slot] = f"    {m.group(1)} = {m.group(2)}"
  pattern = re.compile("|".join(re.escape(n) + r"(?![\w$.-])"
                                for n in sorted(names, key=len, reverse=True)))
  return pattern.sub(lambda m: names[m.group(0)], "\n".join(lines))


def normalize_text(text: str) -> str:
  """Removes symbol visibility and sorts the functions after the entry."""
  text = text.replace("func.func private @", "func.func @")
  head, *funcs = _FUNC.split(text)
  funcs = [_sort_constants("  func.func " + f.rstrip("\n}").rstrip() + "\n")
           for f in funcs]
  if not funcs:
    return text
  tail = text[text.rstrip().rfind("\n"):]
  entry = next((f for f in funcs if "window_params" in f.splitlines()[0]
                or "iteration_bounds" in f.splitlines()[0]), funcs[0])
  rest = sorted((f for f in funcs if f is not entry),
                key=lambda f: f.split("(")[0])
  return head + "".join([entry] + rest) + tail.strip() + "\n"


def _custom_calls(lowered) -> list:
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          inner = inner.operation
          if (inner.name == "stablehlo.custom_call"
              and ir.StringAttr(inner.attributes["call_target_name"]).value
              == "tpu_custom_call"):
            found.append(inner)
          walk(inner)

  module = lowered.compiler_ir("stablehlo")
  walk(module.operation)
  calls = []
  for op in found:
    config = json.loads(ir.StringAttr(op.attributes["backend_config"]).value)
    body = config["custom_call_config"].pop("body")
    debug_locations = config["custom_call_config"].pop("debug_locations",
                                                       None)
    attrs = {a: str(op.attributes[a]) for a in CALL_ATTRS
             if a in op.attributes}
    calls.append(Call(*decode_call(body, debug_locations), config, attrs))
  return calls


# Pallas asks the device for the TPU generation's tiling (1-D blocks); on a
# CPU it must be named by an abstract mesh.
TPU_KIND = "TPU v5 lite"


def _target_tpu():
  from dsl.core.jax_internals import mesh as mesh_lib
  device = mesh_lib.AbstractDevice(device_kind=TPU_KIND, num_cores=1,
                                   platform="tpu")
  mesh = mesh_lib.AbstractMesh((1,), ("_tpu",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def lower_tpu(f, *args) -> list[Call]:
  """The tpu_custom_calls of `f(*args)` lowered for a TPU."""
  try:
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
  except ValueError as e:
    if "Unsupported TPU device kind" not in str(e):
      raise
    with _target_tpu():
      lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
  return _custom_calls(lowered)


_OP = re.compile(r"^\s*(?:%[^=]+= )?\"?([a-z_]+\.[a-z_0-9.]+)", re.M)


def op_difference(ours: str, theirs: str):
  """(ops only ours has, ops only theirs has) as Counters of op names."""
  a = collections.Counter(_OP.findall(ours))
  b = collections.Counter(_OP.findall(theirs))
  return a - b, b - a


def diff(ours: str, theirs: str) -> str:
  return "\n".join(difflib.unified_diff(
      theirs.splitlines(), ours.splitlines(), "pallas", "dsl", lineterm="",
      n=2))


def compare(ours: list[Call], theirs: list[Call], sources=()) -> list[str]:
  """Every difference between the two lowerings, as readable text, and
  every problem with our locations (mosaic_locations.py): `sources` are the
  files of the kernel's source, where each user frame we name must be."""
  problems = []
  if len(ours) != len(theirs):
    return [f"{len(ours)} custom calls, Pallas has {len(theirs)}"]
  for k, (a, b) in enumerate(zip(ours, theirs)):
    if a.module != b.module:
      problems.append(f"call {k}: module differs:\n{diff(a.module, b.module)}")
    if a.config != b.config:
      problems.append(f"call {k}: backend_config {a.config} != {b.config}")
    if a.attrs != b.attrs:
      problems.append(f"call {k}: attributes {a.attrs} != {b.attrs}")
    problems += [f"call {k}: {p}" for p in
                 locations.check_frames(a.located, sources)
                 + locations.check_against(a.located, b.located)]
  return problems
