"""Reports: the terminal table, JSON and CSV."""
from __future__ import annotations

import csv
import json
import math

from benchmarks import peers as peer_names

LEGEND = (
    "time: {stat} over the repeats ± half their interquartile range / median "
    "(\"1 run\": one call, no repeats); samples interleave dsl and peers.\n"
    "vs X: dsl time / X time, lower is better (0.50x = twice as fast, "
    "1/8x = 8 times as fast); X's own time in brackets.\n"
    "mem: peak bytes / (inputs + outputs), from XLA's memory analysis of the "
    "compiled program. check: dsl's output against XLA's.")


def fmt_time(s: float | None) -> str:
  if s is None or not math.isfinite(s):
    return "-"
  if s >= 1:
    return f"{s:.2f} s"
  if s >= 1e-3:
    return f"{s * 1e3:.3g} ms"
  return f"{s * 1e6:.3g} us"


def fmt_ratio(r: float | None) -> str:
  if r is None or not math.isfinite(r):
    return "-"
  if r >= 0.1:
    return f"{r:.2f}x" if r < 10 else f"{r:.3g}x" if r < 1000 else f"{r:.0f}x"
  return f"1/{1 / r:.3g}x" if 1 / r < 1000 else f"1/{1 / r:.0f}x"


def fmt_rate(v: float | None, unit: str) -> str:
  if v is None:
    return "-"
  if unit == "B/s":
    return f"{v / 1e9:.3g} GB/s"
  if v >= 1e12:
    return f"{v / 1e12:.3g} TFLOP/s"
  return f"{v / 1e9:.3g} GFLOP/s"


_CONFIG_ORDER = ("variant", "block", "block_rows", "bm", "bn", "bk",
                 "block_sizes", "block_q", "block_k", "num_warps", "num_stages")


def fmt_config(config: dict) -> str:
  parts = []
  rank = {k: i for i, k in enumerate(_CONFIG_ORDER)}
  for k, v in sorted(config.items(), key=lambda kv: rank.get(kv[0], 99)):
    k = {"num_warps": "w", "num_stages": "s", "block_rows": "rows"}.get(k, k)
    if isinstance(v, (list, tuple)):
      v = "x".join(str(x) for x in v)
    parts.append(f"{v}" if k == "variant" else f"{k}={v}")
  return " ".join(parts) or "-"


class Notes:
  """Long messages become numbered footnotes."""

  def __init__(self):
    self.items: list[str] = []

  def short(self, text: str, width: int = 26) -> str:
    if len(text) <= width:
      return text
    if text in self.items:
      n = self.items.index(text) + 1
    else:
      self.items.append(text)
      n = len(self.items)
    head = text.split(":")[0]
    return f"{head[:width - 6]} [{n}]"


def _time_cell(cell, notes, stat) -> str:
  if not cell.ok:
    return notes.short(cell.note or "error")
  st = cell.stats
  if len(st.samples) == 1:
    return f"{fmt_time(st.value(stat))} (1 run)"
  return f"{fmt_time(st.value(stat))} ±{st.spread:.0%}"


def _peer_cell(row, name, notes) -> str:
  cell = row.peers.get(name)
  if cell is None:
    return "-"
  if not cell.ok:
    return notes.short(cell.note or "error")
  extra = ", 1 run" if len(cell.stats.samples) == 1 else ""
  t = fmt_time(cell.stats.value(row.stat))
  if not row.dsl.ok:
    return f"- ({t}{extra})"
  return f"{fmt_ratio(row.ratio(name))} ({t}{extra})"


def table_rows(rows):
  notes = Notes()
  header = ["kernel", "size", "backend", "config", "time"] + [
      f"vs {peer_names.PEER_TITLES[p]}" for p in peer_names.PEERS] + [
      "throughput", "%peak", "mem", "check"]
  body = []
  for r in rows:
    c = r.case
    mem = r.dsl.stats.memory if r.dsl.ok else None
    check = r.check if r.check != "MISMATCH" else f"MISMATCH {r.max_err:.1e}"
    body.append([
        c.bench.name, _size_label(c.size), c.backend,
        fmt_config(c.config if c.shown is None else c.shown),
        _time_cell(r.dsl, notes, r.stat)] + [
        _peer_cell(r, p, notes) for p in peer_names.PEERS] + [
        fmt_rate(r.throughput, r.throughput_unit),
        _peak_cell(r.peak_fraction),
        "-" if mem is None else f"{mem.ratio:.2f}x", check])
  return header, body, notes


def _peak_cell(fraction) -> str:
  if fraction is None:
    return "-"
  return f"{fraction:.0%}" + ("!" if fraction > 1 else "")   # see the notes


def _size_label(size):
  from benchmarks import sizes
  return sizes.label(size)


def render_table(header, body) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
  def line(cells):
    return "  ".join(str(x).ljust(w) for x, w in zip(cells, widths)).rstrip()
  out = [line(header), line(["-" * w for w in widths])]
  out += [line(b) for b in body]
  return "\n".join(out)


def render(meta: dict, rows, goals: list[dict], extra_notes=()) -> str:
  d = meta["device"]
  lines = [
      f"dsl benchmarks  {meta['date']}  {d['platform']} ("
      + (f"{d['device_kind']}, " if d["device_kind"] != d["platform"] else "")
      + f"{d['cpu_count']} CPU cores)  jax {d['jax']}  dtype {meta['dtype']}  "
      f"warm-up {meta['warmup']}, repeats {meta['repeats']}"]
  pk = meta.get("peak")
  if pk:
    lines.append(
        f"device peak, measured in this run: {pk['matmul']}: "
        f"{fmt_rate(pk['flop_per_s'], 'FLOP/s')}; {pk['copy']}: "
        f"{fmt_rate(pk['bytes_per_s'], 'B/s')} (read + write)")
  lines.append("")
  header, body, notes = table_rows(rows)
  lines.append(render_table(header, body))
  lines.append("")
  lines.append(LEGEND.format(stat=meta.get("stat", "median")))
  for n, text in enumerate(notes.items, 1):
    lines.append(f"[{n}] {text}")
  for text in extra_notes:
    lines.append(text)
  if goals:
    lines.append("")
    lines.append("Interpret-speed goals, from the rows above:")
    for g in goals:
      lines.append(
          f"  {g['case']}: dsl {fmt_time(g['dsl_s'])} = "
          f"{fmt_ratio(g['ratio_to_xla'])} XLA (goal <= {g['ratio_goal']:g}x: "
          f"{g['ratio_status']}); Pallas interpret "
          + (f"{fmt_time(g['pallas_interpret_s'])} = "
             f"{fmt_ratio(g['pallas_ratio_to_xla'])} XLA"
             if g["pallas_interpret_s"] is not None else
             (g["pallas_note"] or "n/a")))
      if g["memory_ratio"] is not None:
        lines.append(
            f"    peak memory {g['peak_bytes'] / 2**20:.1f} MiB = "
            f"{g['memory_ratio']:.2f}x inputs+outputs "
            f"({g['io_bytes'] / 2**20:.1f} MiB; goal <= ~2x: "
            f"{g['memory_status']})"
            + (f"; Pallas interpret {g['pallas_memory_ratio']:.2f}x"
               if g["pallas_memory_ratio"] is not None else ""))
  return "\n".join(lines)


def to_json(meta, rows, goals) -> dict:
  return {"meta": meta, "rows": [r.as_dict() for r in rows], "goals": goals}


def write_json(path, meta, rows, goals):
  with open(path, "w") as f:
    json.dump(to_json(meta, rows, goals), f, indent=1, default=_jsonable)
    f.write("\n")


def _jsonable(x):
  if hasattr(x, "item"):
    return x.item()
  return str(x)


CSV_FIELDS = [
    "kernel", "source", "size", "dtype", "backend", "config", "config_source",
    "median_s", "q1_s", "q3_s", "min_s", "max_s", "repeats", "compile_s",
    "dsl_note"] + [f"{p}_{f}" for p in peer_names.PEERS
                   for f in ("median_s", "ratio", "runs", "note")] + [
    "throughput", "throughput_unit", "peak_fraction", "peak_bytes",
    "io_bytes", "mem_ratio", "check", "max_rel_err"]


def write_csv(path, rows):
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, CSV_FIELDS)
    w.writeheader()
    for r in rows:
      c = r.case
      st = r.dsl.stats
      mem = st.memory if st else None
      rec = {"kernel": c.bench.name, "source": c.bench.source,
             "size": "x".join(map(str, c.size)), "dtype": r.dtype,
             "backend": c.backend, "config": json.dumps(c.config,
                                                         sort_keys=True),
             "config_source": c.config_source, "dsl_note": r.dsl.note,
             "throughput": r.throughput, "throughput_unit": r.throughput_unit,
             "peak_fraction": r.peak_fraction, "check": r.check,
             "max_rel_err": r.max_err}
      if st:
        rec.update(median_s=st.median, q1_s=st.q1, q3_s=st.q3,
                   min_s=min(st.samples), max_s=max(st.samples),
                   repeats=len(st.samples), compile_s=st.compile_s)
      if mem:
        rec.update(peak_bytes=mem.peak, io_bytes=mem.io, mem_ratio=mem.ratio)
      for p in peer_names.PEERS:
        cell = r.peers.get(p)
        if cell is None:
          continue
        rec[f"{p}_note"] = cell.note
        if cell.ok:
          rec[f"{p}_median_s"] = cell.stats.median
          rec[f"{p}_runs"] = len(cell.stats.samples)
          rec[f"{p}_ratio"] = r.ratio(p)
      w.writerow(rec)
