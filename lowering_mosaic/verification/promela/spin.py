"""Running SPIN on a model: `spin -a`, the C compiler, `pan`, the replay.

`run_spin(text)` writes the model into a fresh directory, generates the
verifier (`spin -a model.pml`), compiles `pan.c` for a safety search with
bounded memory (`-DSAFETY -DMEMLIM=<MB>`), runs it with a depth limit and a
wall-clock limit (SIGINT when time is up: pan then prints how far it got),
and, when it finds an error, replays the trail (`spin -t -p -g`) and
translates it (trail.py).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Optional

from lowering_mosaic.verification.promela import trail as T
from lowering_mosaic.verification.promela.error_table import KIND_OF_ASSERTION
from lowering_mosaic.verification.promela.spin_report import Report

INSTALL_HINT = ("SPIN (the Promela model checker) is needed to verify "
                "kernels; install it with `apt-get install spin` (Debian/"
                "Ubuntu; run `apt-get update` first), or put a `spin` binary "
                "on PATH / in $SPIN")


class SpinNotFoundError(RuntimeError):
  """No `spin` binary (or no C compiler) on this machine."""


class SpinError(RuntimeError):
  """SPIN rejected a model or the verifier failed to build."""


def find_spin() -> Optional[str]:
  """The `spin` binary: $SPIN, PATH, or /usr/bin/spin; None if missing."""
  env = os.environ.get("SPIN")
  if env and os.path.isfile(env) and os.access(env, os.X_OK):
    return env
  found = shutil.which("spin")
  if found:
    return found
  for p in ("/usr/bin/spin", "/usr/local/bin/spin"):
    if os.path.isfile(p) and os.access(p, os.X_OK):
      return p
  return None


def find_cc() -> Optional[str]:
  for c in (os.environ.get("CC"), "gcc", "cc", "clang"):
    if c and shutil.which(c):
      return shutil.which(c)
  return None


def spin_available() -> tuple[bool, str]:
  """(True, "") or (False, why) — for tests to skip with a reason."""
  if find_spin() is None:
    return False, "spin is not installed: " + INSTALL_HINT
  if find_cc() is None:
    return False, "no C compiler (gcc/cc) to build SPIN's verifier"
  return True, ""


def require_spin() -> tuple[str, str]:
  spin, cc = find_spin(), find_cc()
  if spin is None:
    raise SpinNotFoundError("spin was not found. " + INSTALL_HINT)
  if cc is None:
    raise SpinNotFoundError("no C compiler (gcc or cc) was found to build "
                            "SPIN's verifier pan.c; install gcc")
  return spin, cc


def _run(cmd, cwd, timeout):
  return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                        timeout=timeout)


def _pan(cmd, cwd, timeout_s) -> tuple[str, bool, float]:
  """Runs pan; on time out sends SIGINT (pan prints its statistics)."""
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  timed_out = False
  try:
    out, _ = p.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    timed_out = True
    p.send_signal(signal.SIGINT)
    try:
      out, _ = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      out, _ = p.communicate()
  return out, timed_out, time.perf_counter() - t0


def _int(pattern, text, default=0) -> int:
  m = re.search(pattern, text)
  return int(float(m.group(1))) if m else default


def parse_pan(out: str) -> dict:
  """Statistics and verdict from pan's output."""
  stats = {
      "states": _int(r"(\d+(?:\.\d+)?(?:e\+\d+)?) states, stored", out),
      "transitions": _int(r"(\d+(?:\.\d+)?(?:e\+\d+)?) transitions", out),
      "depth": _int(r"depth reached (\d+)", out),
      "errors": _int(r"errors: (\d+)", out),
      "elapsed": float(re.search(r"elapsed time ([\d.e+]+)", out).group(1))
      if re.search(r"elapsed time ([\d.e+]+)", out) else 0.0,
  }
  m = re.search(r"pan:\d+: (.*?) \(at depth (\d+)\)", out)
  stats["error"] = m.group(1) if m else None
  if stats["states"] == 0:
    # Interrupted runs print a progress line instead of the summary.
    m = re.findall(r"Depth=\s*(\d+) States=\s*([\d.e+]+)", out)
    if m:
      stats["depth"] = max(stats["depth"], int(m[-1][0]))
      stats["states"] = int(float(m[-1][1]))
  stats["depth_limited"] = "max search depth too small" in out
  stats["memory_limited"] = "reached -DMEMLIM bound" in out
  stats["interrupted"] = "Interrupted" in out
  stats["incomplete"] = "Search not completed" in out
  return stats


def _kind_of_error(error: str) -> str:
  if error.startswith("assertion violated"):
    name = error.split()[-1]
    return KIND_OF_ASSERTION.get(name, "error")
  if error.startswith("invalid end state"):
    return "deadlock"
  return "error"


def run_spin(text: str, *, max_depth: int = 200_000, timeout_s: float = 60.0,
             memory_mb: int = 512, hash_bits: int = 20,
             workdir: Optional[str] = None, keep: bool = False,
             name: str = "model") -> Report:
  """Verifies a Promela model written by builder.py (or any model: then
  the trail has no kernel lines). Returns a `Report`."""
  spin, cc = require_spin()
  t0 = time.perf_counter()
  info = T.ModelInfo.parse(text)
  tmp = workdir or tempfile.mkdtemp(prefix="promela-")
  os.makedirs(tmp, exist_ok=True)
  try:
    pml = os.path.join(tmp, f"{name}.pml")
    with open(pml, "w") as fh:
      fh.write(text)
    r = _run([spin, "-a", os.path.basename(pml)], tmp, 120)
    if r.returncode != 0 or not os.path.exists(os.path.join(tmp, "pan.c")):
      raise SpinError(f"spin -a rejected the model {pml}:\n{r.stdout}{r.stderr}")
    for stale in (pml + ".trail", os.path.join(tmp, "pan")):
      if os.path.exists(stale):
        os.remove(stale)
    # Small models: compile fast; several kernel processes: search fast.
    opt = "-O1" if info.devices * info.par >= 4 else "-O0"
    cflags = [opt, "-w", "-DSAFETY", "-DNOFAIR", f"-DMEMLIM={int(memory_mb)}",
              "-DVECTORSZ=8192"]
    r = _run([cc, *cflags, "-o", "pan", "pan.c"], tmp, 300)
    if r.returncode != 0:
      raise SpinError(f"compiling SPIN's verifier failed:\n{r.stderr[-4000:]}")
    out, timed_out, search_s = _pan(
        ["./pan", f"-m{int(max_depth)}", f"-w{int(hash_bits)}", "-n"], tmp,
        timeout_s)
    st = parse_pan(out)
    rep = Report(kind="ok", kernel=info.kernel, states=st["states"],
                 transitions=st["transitions"], depth=st["depth"],
                 max_depth=int(max_depth), search_s=search_s,
                 num_devices=info.devices, notes=list(info.notes),
                 pan_output=out, model_path=pml if (keep or workdir) else None)
    if st["error"]:
      rep.kind = _kind_of_error(st["error"])
      trail_file = pml + ".trail"
      if os.path.exists(trail_file):
        r = _run([spin, "-t", "-p", "-l", os.path.basename(pml)], tmp, 120)
        tr = T.translate(info, r.stdout, rep.kind)
        rep.trail = tr.steps
        rep.blocked = tr.blocked if rep.kind == "deadlock" else []
        rep.message, rep.error_line = tr.message, tr.error_line
      if not rep.message:
        rep.message = f"SPIN: {st['error']}"
    elif timed_out or st["interrupted"]:
      rep.kind = "bound"
      rep.message = (f"bound: the search hit the time limit ({timeout_s:g} s) "
                     f"after {rep.states} states, depth {rep.depth}; no error "
                     "up to there")
    elif st["memory_limited"]:
      rep.kind = "bound"
      rep.message = (f"bound: the search hit the memory limit ({memory_mb} MB)"
                     f" after {rep.states} states, depth {rep.depth}; no error"
                     " up to there")
    elif st["depth_limited"] or st["incomplete"]:
      rep.kind = "bound"
      rep.message = (f"bound: the search hit the depth limit (max_depth="
                     f"{max_depth}) after {rep.states} states; no error up to"
                     " that depth")
    rep.time_s = time.perf_counter() - t0
    return rep
  finally:
    if not (keep or workdir):
      shutil.rmtree(tmp, ignore_errors=True)
