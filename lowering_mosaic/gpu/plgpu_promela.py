"""The mbarrier protocol of an explicit `plgpu.kernel` as a Promela model
(the text; SPIN runs on it in plgpu_model.py, which the Mosaic GPU
lowering does not import: its dump needs the text only). The model is
described in plgpu_model.py's docstring."""
from __future__ import annotations

import re
import warnings

from dsl.core import config
from lowering_mosaic.gpu.plgpu_skeleton import (Choice, Event, Skeleton,
                                                skeleton)
from lowering_mosaic.model_files import write_model

MARK = "@@plgpu"      # the header line that says a model is one of these


def _fail(code: str, ev: Event, arg: int) -> str:
  return (f"printf(\"@@E {code} {ev.id} {arg}\\n\"); assert(no_race)")


def _check(cond: str, code: str, ev: Event, arg: int) -> str:
  return f"if :: {cond} -> skip :: else -> {_fail(code, ev, arg)} fi"


def _complete(b: int, n: int) -> str:
  return (f"if :: pend[{b}] == 0 && tx[{b}] == 0 -> done[{b}]++; "
          f"pend[{b}] = {n} :: else -> skip fi")


def _arrive(sk: Skeleton, ev: Event) -> str:
  b = ev.barrier
  return (f"if :: pend[{b}] > 0 -> pend[{b}]-- :: else -> "
          f"{_fail('over', ev, b)} fi; {_complete(b, sk.num_arrivals(b))}")


def _reads(ev: Event) -> list[str]:
  return [s for c in ev.cells for s in (
      _check(f"land[{c}] == 0", "landing_read", ev, c),
      _check(f"filled[{c}]", "empty_read", ev, c))]


def _writes(ev: Event) -> list[str]:
  return [s for c in ev.cells for s in (
      _check(f"land[{c}] == 0", "landing_write", ev, c),
      _check(f"rd[{c}] == 0", "reader_write", ev, c))]


def _load(sk, ev, pairs):
  return [*_writes(ev), f"tx[{ev.barrier}]++", _arrive(sk, ev),
          *[f"land[{c}]++" for c in ev.cells],
          f"fly[{pairs[(ev.cells, ev.barrier)]}]++"]


_STEPS = {
    "load": _load,
    "store": lambda sk, ev, _: [*_reads(ev), *[f"rd[{c}]++" for c in ev.cells]],
    "mma": lambda sk, ev, _: [*_reads(ev), *[f"rd[{c}]++" for c in ev.cells]],
    "read": lambda sk, ev, _: _reads(ev),
    "write": lambda sk, ev, _: [*_writes(ev),
                                *[f"filled[{c}] = 1" for c in ev.cells]],
    "retire": lambda sk, ev, _: [f"rd[{c}]--" for c in ev.cells],
    "arrive": lambda sk, ev, _: [_arrive(sk, ev)],
    "unwaited": lambda sk, ev, _: [_fail("unwaited", ev, 0)],
}


def _statement(sk: Skeleton, ev: Event, pairs: dict) -> str:
  if ev.kind == "wait":
    b = ev.barrier
    return (f"printf(\"@@W {ev.id}\\n\");\n  atomic {{ done[{b}] > seen[{b}] "
            f"-> {_check(f'done[{b}] == seen[{b}] + 1', 'parity', ev, b)}; "
            f"seen[{b}]++; printf(\"@@P {ev.id}\\n\") }}")
  body = "; ".join([f"printf(\"@@S {ev.id}\\n\")",
                    *_STEPS[ev.kind](sk, ev, pairs)])
  return f"atomic {{ {body} }}"


def _program(sk: Skeleton, nodes: list, pairs: dict, indent: str) -> str:
  out = []
  for node in nodes:
    if isinstance(node, Choice):
      arms = "".join(
          f"{indent}:: true ->\n{_program(sk, arm, pairs, indent + '   ')}"
          if arm else f"{indent}:: true -> skip\n" for arm in node.branches)
      out.append(f"{indent}if   /* a condition on data at {node.line} */\n"
                 f"{arms}{indent}fi;\n")
    else:
      text = _statement(sk, node, pairs).replace("\n", "\n" + indent)
      out.append(f"{indent}{text};\n")
  return "".join(out) or f"{indent}skip;\n"


def _pairs(sk: Skeleton) -> dict:
  """(cells, barrier) of every TMA copy into SMEM -> its index."""
  pairs: dict = {}
  for ev in sk.events:
    if ev.kind == "load":
      pairs.setdefault((ev.cells, ev.barrier), len(pairs))
  return pairs


def _engine(sk: Skeleton, pairs: dict) -> str:
  if not pairs:
    return ""
  arms = []
  for (cells, b), p in pairs.items():
    lands = "; ".join(f"land[{c}]--; filled[{c}] = 1" for c in cells)
    arms.append(f"  :: atomic {{ fly[{p}] > 0 -> fly[{p}]--; {lands}; "
                f"tx[{b}]--; printf(\"@@L {p}\\n\"); "
                f"{_complete(b, sk.num_arrivals(b))} }}\n")
  return ("/* The TMA engine: lands any copy in flight, in any order. */\n"
          "active proctype tma() {\nend:\n  do\n" + "".join(arms)
          + "  od\n}\n\n")


def _header(sk: Skeleton, pairs: dict) -> str:
  name = re.sub(r"\W", "_", sk.kernel) or "kernel"
  lines = [f"/* The mbarrier protocol of the plgpu kernel {sk.kernel}:",
           f" * @@model kernel={name} devices=1 par=1",
           f" * {MARK} warpgroups={len(sk.programs)}"]
  lines += [f" * loop at {line}: {' or '.join(map(str, n))} steps"
            for line, n in sk.loops.items()]
  lines += [f" * @@wg {w} {sk.wg_name(w)}" for w in range(len(sk.programs))]
  lines += [f" * @@ev {e.id} {e.wg} {e.line or '-'} | {e.what}"
            for e in sk.events]
  lines += [f" * @@cell {c} {sk.cell_name(c)}" for c in range(sk.num_cells)]
  lines += [f" * @@bar {b} {sk.num_arrivals(b)} {sk.barrier_name(b)}"
            for b in range(sk.num_barriers)]
  lines += [f" * @@pair {p} {b} {sk.cells_name(cells)}"
            for (cells, b), p in pairs.items()]
  lines += [f" * note: {n}" for n in sk.notes]
  return "\n".join(lines).replace("*/", "* /") + "\n */\n"


def to_promela(sk: Skeleton) -> str:
  """The Promela model of the skeleton `sk` (plgpu_skeleton.skeleton)."""
  for b in range(sk.num_barriers):
    if not 1 <= sk.num_arrivals(b) <= 255:
      raise ValueError(f"kernel {sk.kernel}: {sk.barrier_name(b)} expects "
                       f"{sk.num_arrivals(b)} arrivals; the model counts "
                       "up to 255")
  pairs = _pairs(sk)
  nb, nc = max(sk.num_barriers, 1), max(sk.num_cells, 1)
  state = (f"bool no_race = false;   /* asserted where a check fails */\n"
           f"byte done[{nb}]; byte pend[{nb}]; byte tx[{nb}];\n"
           f"byte land[{nc}]; byte rd[{nc}]; bool filled[{nc}];\n"
           f"byte fly[{max(len(pairs), 1)}];\n\n")
  procs = "".join(
      f"proctype wg{w}() {{\n  byte seen[{nb}];\n"
      f"{_program(sk, prog, pairs, '  ')}}}\n\n"
      for w, prog in enumerate(sk.programs))
  init = ("init {\n  atomic {\n"
          + "".join(f"    pend[{b}] = {sk.num_arrivals(b)};\n"
                    for b in range(sk.num_barriers))
          + "".join(f"    run wg{w}();\n" for w in range(len(sk.programs)))
          + "  }\n}\n")
  return _header(sk, pairs) + state + _engine(sk, pairs) + procs + init


def is_plgpu_kernel(spec) -> bool:
  """Whether `spec` is a `plgpu.kernel`'s (its compiler params carry a
  Mesh)."""
  return getattr(spec.compiler_params, "mesh", None) is not None


def kernel_model(spec) -> str:
  """The Promela model of the `plgpu.kernel` of `spec` (a KernelSpec)."""
  return to_promela(skeleton(spec))


def maybe_dump(spec) -> str | None:
  """Writes the model of a `plgpu.kernel` to `jax_pallas_dump_promela_to`
  when that option is set (the mosaic_gpu backend calls it on each kernel
  it lowers); returns the path. A kernel the model cannot follow gives a
  warning, never a failed lowering."""
  directory = config.dump_promela_to()
  if not directory or not is_plgpu_kernel(spec):
    return None
  try:
    text = kernel_model(spec)
  except Exception as e:  # noqa: BLE001 - a dump must not break lowering
    warnings.warn(f"jax_pallas_dump_promela_to: no Promela model for kernel "
                  f"{spec.name}: {e}", RuntimeWarning, stacklevel=2)
    return None
  return write_model(text, spec.name, directory)
