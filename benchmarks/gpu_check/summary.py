"""What the GPU check prints at the end: the rows slower than last time, the
refreshed defaults, the quick suite's GPU rows against their goals, and a
short table of the phases (last)."""
from __future__ import annotations

# Quick-suite goals: dsl time / XLA time, per row. XLA calls a library
# (cuBLAS, cuDNN) for these kernels; elsewhere it fuses plain code.
LIBRARY_KERNELS = ("matmul", "kernels.matmul", "kernels.flash_attention")
LIBRARY_GOAL, FUSED_GOAL = 1.1, 1.0
GPU_BACKENDS = ("triton", "mosaic_gpu")


def goals(rec: dict) -> list[dict]:
  """The quick phase's GPU rows: ratio to XLA, goal, met."""
  rows = [r for r in rec.get("rows", []) if r["phase"] == "quick"]
  xla = {r["id"].rsplit("|", 1)[0]: r for r in rows if r["impl"] == "xla"}
  out = []
  for r in rows:
    if r["impl"] != "dsl" or r.get("backend") not in GPU_BACKENDS:
      continue
    x = xla.get(r["id"].rsplit("|", 1)[0])
    ratio = (r["time_s"] / x["time_s"] if r["ok"] and x and x["ok"]
             and x["time_s"] else None)
    goal = LIBRARY_GOAL if r["kernel"] in LIBRARY_KERNELS else FUSED_GOAL
    out.append({"row": r["id"].split("|")[1], "ratio": ratio, "goal": goal,
                "met": ratio is not None and ratio <= goal})
  return out


def _phase_note(name: str, p: dict, rec: dict) -> str:
  if name == "tests" and "tests" in rec:
    t = rec["tests"]
    note = f"{t['passed']} passed, {len(t['failed'])} failed, " \
           f"{t['skipped']} skipped"
    return note + (f" ({', '.join(t['failed'][:3])}"
                   + (", ..." if len(t["failed"]) > 3 else "") + ")"
                   if t["failed"] else "")
  if p["status"] != "ok":
    last = [l for l in p.get("tail", "").splitlines() if l.strip()]
    return p.get("note") or (last[-1][:90] if last else "")
  return p.get("note", "")


def table(rec: dict) -> str:
  head = ["phase", "status", "time/budget", "rows", "note"]
  body = [[n, p["status"], f"{p['wall_s']:.0f}/{p['budget_s']} s",
           str(p.get("rows", "-")), _phase_note(n, p, rec)]
          for n, p in rec["phases"].items()]
  widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
  fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in
                                zip(cells, widths)).rstrip()
  total = sum(p["wall_s"] for p in rec["phases"].values())
  return "\n".join([fmt(head), fmt(["-" * w for w in widths])]
                   + [fmt(b) for b in body]
                   + [f"phases took {total:.0f} s in all"])


def _value(v, unit):
  if v is None:
    return "-"
  return f"{v * 1e3:.4g} ms" if unit == "s" else f"{v:.4g} {unit}"


def render(rec: dict, previous: dict | None, slower: list[dict],
           changes: list[str], path: str, refreshed: bool) -> str:
  c = rec.get("commit", {})
  v = rec.get("versions", {})
  lines = [f"GPU check  {rec['device_kind']}  {rec['date']}  commit "
           f"{c.get('sha', '?')[:10]}{' (dirty)' if c.get('dirty') else ''}"
           f"  jax {v.get('jax')}  triton {v.get('triton')}", ""]
  if previous is None:
    lines.append("No earlier record of this device kind: nothing to compare.")
  else:
    lines.append(f"Rows more than 10% slower than the record of "
                 f"{previous['date']} (commit "
                 f"{previous.get('commit', {}).get('sha', '?')[:10]}): "
                 f"{len(slower) or 'none'}")
    for s in slower:
      lines.append(f"  {s['slowdown']:.2f}x  {s['id']}  ("
                   f"{_value(s['before'], s['unit'])} -> "
                   f"{_value(s['now'], s['unit'])})")
  lines.append("")
  for name, p in rec.get("phases", {}).items():
    for note in p.get("peak_notes") or []:
      lines += [f"{name}: {note}", ""]
  met = goals(rec)
  if met:
    missed = [g for g in met if not g["met"]]
    lines.append(f"Quick suite GPU rows vs XLA (<= {LIBRARY_GOAL}x where XLA "
                 f"calls a library, <= {FUSED_GOAL}x elsewhere): "
                 f"{len(met) - len(missed)} of {len(met)} met")
    for g in missed:
      ratio = "no time" if g["ratio"] is None else f"{g['ratio']:.2f}x"
      lines.append(f"  missed: {g['row']} {ratio} (goal {g['goal']}x)")
    lines.append("")
  if not refreshed:
    lines.append("Shipped defaults: not refreshed (--no-update-defaults).")
  else:
    lines.append(f"Shipped defaults (dsl/tools/data/gpu_*.json): "
                 f"{len(changes) or 'no'} change(s)")
    lines += [f"  {ch}" for ch in changes]
  lines += ["", f"record: {path}", "", table(rec)]
  return "\n".join(lines)
