"""The shipped GPU defaults refreshed from a GPU check's record: the winning
configs (`dsl/tools/data/gpu_configs.json`) and each kernel's faster backend
(`dsl/tools/data/gpu_backends.json`), as entries of the record's device kind.

Winners come from rows that timed several configs of one kernel and size in
the same run: the tune phase (`--autotune` from the shipped default, which
it times first) and the Triton phase (its fixed config list). A winner
replaces the config in force only when it beats it by `MARGIN` in the same
run, so noise does not flip entries back and forth; where the config in
force was not timed, the winner is written. The backend choice compares
`triton` and `mosaic_gpu` rows of each kernels/ kernel (mosaic phase):
Mosaic GPU is chosen only if it ran every size Triton ran and was faster by
`MARGIN` over them (geometric mean of the time ratios).
"""
from __future__ import annotations

import copy
import math

from dsl.tools import gpu_defaults

MARGIN = 0.03


def _source(record: dict, what: str) -> str:
  sha = (record.get("commit") or {}).get("sha", "?")[:10]
  return (f"{record['device_kind']}, {record['date'][:10]}: python -m "
          f"benchmarks.gpu_check (commit {sha}), {what}")


def _key(kernel, backend, size, dtype) -> str:
  return f"{kernel}/{backend}/{size}:{dtype}"


def _in_force(kernel, backend, size, dtype, configs, device) -> dict | None:
  dims = tuple(int(d) for d in size.split("x"))
  hit = gpu_defaults.lookup(kernel, dims, dtype, backend, device=device,
                            path=configs)
  return hit.config if hit else None



def _timed(results) -> list:
  return [(c, s) for c, s in results if isinstance(s, (int, float))]


def _winner(kernel, backend, size, dtype, timed, before, how) -> dict:
  """`before`: the config in force (None if unknown); its time if timed."""
  best, best_s = min(timed, key=lambda cs: cs[1])
  before_s = next((s for c, s in timed if c == before), None)
  return {"key": _key(kernel, backend, size, dtype), "best": best,
          "best_s": best_s, "before": before, "before_s": before_s,
          "timed": len(timed), "how": how}


def tune_winners(record: dict) -> list[dict]:
  """From the tune phase: per row, the winner against the config the search
  started from (the shipped or the kernel's default, timed first)."""
  out = []
  for r in record.get("rows", []):
    t = r.get("tuning")
    if r["phase"] != "tune" or r["impl"] != "dsl" or not t or not r["ok"]:
      continue
    timed = _timed(t["results"])
    if timed:
      first = t["results"][0][0]     # the row's config before tuning
      out.append(_winner(r["kernel"], r["backend"], r["size"], r["dtype"],
                         timed, first, "autotune"))
  return out


def triton_winners(record: dict, configs_path: str) -> list[dict]:
  """From the Triton phase: per benchmark, the configs of "ours", against
  the config in force for the record's device."""
  groups: dict = {}
  for r in record.get("rows", []):
    if r["phase"] != "triton" or r["impl"] != "ours" or not r.get("kernel") \
        or not r["ok"] or not r.get("config"):
      continue
    groups.setdefault((r["kernel"], r["size"], r["dtype"]), []).append(
        (r["config"], r["time_s"]))
  device = _device(record)
  return [_winner(k, "triton", size, dtype, timed,
                  _in_force(k, "triton", size, dtype, configs_path, device),
                  "benchmarks/gpu_triton.py")
          for (k, size, dtype), timed in sorted(groups.items())]


def _device(record: dict) -> gpu_defaults.Device:
  return gpu_defaults.Device(record["device_kind"], (record.get("device") or {})
                             .get("compute_capability"))


def refresh_configs(record: dict, table: dict, configs_path: str
                    ) -> tuple[dict, list[str]]:
  """A copy of `table` with the record's winners as entries of its device
  kind, and one line per change."""
  table = copy.deepcopy(table)
  kind = record["device_kind"]
  entries = table.setdefault("devices", {}).setdefault(kind, {})
  changes = []
  for w in tune_winners(record) + triton_winners(record, configs_path):
    if not w["best"] or w["best"] == w["before"]:   # {}: the kernel's own
      continue
    if w["before_s"] is not None and \
        w["best_s"] >= w["before_s"] * (1 - MARGIN):
      continue
    before = (f"; the config in force took {w['before_s'] * 1e3:.4g} ms"
              if w["before_s"] is not None else "")
    entries[w["key"]] = {
        "config": w["best"], "measured": {"median_s": w["best_s"]},
        "source": _source(record, f"{w['how']}, best of {w['timed']} timed "
                          f"({w['best_s'] * 1e3:.4g} ms){before}")}
    changes.append(f"{kind}: {w['key']} -> {w['best']}")
  return table, changes


def backend_winners(record: dict) -> dict[str, dict]:
  """kernels/ kernel -> {"backend", "why", "ratio"} from the mosaic phase."""
  by: dict = {}
  for r in record.get("rows", []):
    if r["phase"] == "mosaic" and r["impl"] == "dsl" and \
        r["kernel"].startswith("kernels."):
      by.setdefault(r["kernel"], {}).setdefault(r["size"], {})[
          r["backend"]] = r
  out = {}
  for kernel, sizes in sorted(by.items()):
    pairs = [(s["triton"], s.get("mosaic_gpu")) for s in sizes.values()
             if "triton" in s and s["triton"]["ok"]]
    if not pairs:
      continue
    failed = [m for _, m in pairs if m is None or not m["ok"]]
    if failed:
      m = failed[0]
      note = "not run" if m is None else (
          m["note"] or f"check: {m.get('check')}")
      out[kernel] = {"backend": "triton", "ratio": None, "why": (
          f"mosaic_gpu did not run {len(failed)} of {len(pairs)} sizes "
          f"({note[:100]})")}
      continue
    ratio = math.exp(sum(math.log(m["time_s"] / t["time_s"])
                         for t, m in pairs) / len(pairs))
    backend = "mosaic_gpu" if ratio < 1 - MARGIN else "triton"
    out[kernel] = {"backend": backend, "ratio": ratio, "why": (
        f"mosaic_gpu / triton time {ratio:.2f}x (geometric mean over "
        f"{len(pairs)} sizes, bf16)")}
  return out


def refresh_backends(record: dict, table: dict, backends_path: str
                     ) -> tuple[dict, list[str]]:
  """A copy of `table` with the record's backend choices as entries of its
  device kind, and one line per kernel whose backend changes."""
  table = copy.deepcopy(table)
  entries = table.setdefault("devices", {}).setdefault(
      record["device_kind"], {})
  changes = []
  for kernel, w in backend_winners(record).items():
    old = gpu_defaults.backend_for(kernel, device=_device(record),
                                   path=backends_path)
    entries[kernel] = {"backend": w["backend"],
                       "source": _source(record, w["why"])}
    if w["ratio"] is not None:
      entries[kernel]["measured"] = {"mosaic_gpu_over_triton": w["ratio"]}
    if old is None or old.backend != w["backend"]:
      changes.append(f"{record['device_kind']}: {kernel} -> {w['backend']} "
                     f"({w['why']})")
  return table, changes


def refresh(record: dict, configs_path: str = None,
            backends_path: str = None, write: bool = True) -> list[str]:
  """Refreshes both shipped tables from `record` (written when `write`);
  returns the changes."""
  configs_path = configs_path or gpu_defaults.CONFIGS_PATH
  backends_path = backends_path or gpu_defaults.BACKENDS_PATH
  old_configs = gpu_defaults.load(configs_path)
  old_backends = gpu_defaults.load(backends_path)
  configs, c1 = refresh_configs(record, old_configs, configs_path)
  backends, c2 = refresh_backends(record, old_backends, backends_path)
  if write:
    if configs != old_configs:
      gpu_defaults.write(configs_path, configs)
    if backends != old_backends:    # new measurements, same choices too
      gpu_defaults.write(backends_path, backends)
  return c1 + c2
