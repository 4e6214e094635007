"""Runs one case on every backend, checks it against the reference and
classifies what happened.

Outcomes per backend:
- `agree`: the outputs match the reference (NaN where it has NaN, numbers
  within the dtype's tolerance);
- `disagree`: they do not;
- `refused`: the backend raised `dsl.KernelError` (or `BackendError`) whose
  message names the kernel -- a clear refusal, which is allowed;
- `crash`: any other exception, or (seen by the driver) the process died;
- `skipped`: a feature of the case is listed in `KNOWN_FAILURES` for it;
- `unchecked`: it differs from the reference but Pallas differs too, so the
  generator (or Pallas) is at fault, not the backend.

Pallas (interpret mode) runs every case as the oracle: a Pallas result that
differs from the reference is reported on its own and never counted against
our backends.
"""
from __future__ import annotations

import dataclasses
import time
import traceback

import numpy as np

from tests.pallas.fuzz.families import FAMILIES
from tests.pallas.fuzz.known_failures import known_failure
from tests.pallas.fuzz.spec import Case, is_float
from tests.pallas.testing import CPU_BACKENDS

ORACLE = "pallas"
# Features whose result Pallas's interpret mode gives otherwise by design
# (docs/pallas-compat.md, "Memory nobody defined"): windows placed at run
# time (it clamps them), memory nobody wrote (its integer poison is the
# minimum), atomics through arrays of indices (it keeps one update of
# repeated ones). Where a case has one, Pallas disagreeing says nothing of
# the generator, and our backends are held to the reference regardless.
PALLAS_DIFFERS = frozenset({"window_from_data", "unwritten_rows",
                            "unwritten_read", "atomic_indices"})
COUNTED = ("agree", "refused", "disagree", "crash", "skipped", "unchecked")


@dataclasses.dataclass
class Outcome:
  status: str
  detail: str = ""
  seconds: float = 0.0


@dataclasses.dataclass
class CaseResult:
  case_id: str
  family: str
  features: list[str]
  outcomes: dict[str, Outcome]
  error: str = ""        # the generator or the reference failed

  def to_json(self) -> dict:
    return dict(case=self.case_id, family=self.family, features=self.features,
                error=self.error,
                outcomes={b: [o.status, o.detail, round(o.seconds, 3)]
                          for b, o in self.outcomes.items()})

  @classmethod
  def from_json(cls, d: dict) -> "CaseResult":
    return cls(d["case"], d["family"], d["features"],
               {b: Outcome(*o) for b, o in d["outcomes"].items()},
               d.get("error", ""))


def run_backend(case: Case, backend: str) -> list[np.ndarray]:
  from tests.pallas.fuzz.render import build_call, dsl_mods, pallas_mods
  if backend == ORACLE:
    mods, kw = pallas_mods(), dict(interpret=True)
  else:
    mods, kw = dsl_mods(), dict(backend=backend)
  own = FAMILIES[case.family].run
  if own is not None:
    return own(case, lambda c: build_call(c, mods, **kw))
  f, args = build_call(case, mods, **kw)
  return [np.asarray(o) for o in f(*args)]


def run_jvp(case: Case, backend: str) -> list[np.ndarray]:
  """The tangents of the case's float outputs under `jax.jvp`, for fixed
  random tangents of its float inputs (the jvp kernel dsl derives)."""
  import jax
  from tests.pallas.fuzz.render import build_call, dsl_mods
  f, args = build_call(case, dsl_mods(), backend=backend)
  rng = np.random.default_rng([case.seed, case.index, 11])
  tangents = []
  for a in args:
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.inexact) or a.dtype.name == "bfloat16":
      tangents.append(jax.numpy.asarray(rng.standard_normal(a.shape),
                                        a.dtype))
    else:
      tangents.append(np.zeros(a.shape, jax.dtypes.float0))
  _, outs = jax.jvp(f, tuple(args), tuple(tangents))
  return [np.asarray(o) for o, op in zip(outs, case.outputs)
          if is_float(op.dtype)]


def jvp_mismatch(case: Case, got, want) -> str | None:
  """Why the tangents `got` differ from `want` (the interpret backend's)."""
  floats = [op for op in case.outputs if is_float(op.dtype)]
  tols = [t for t, op in zip(case.param("tol", (0.0,) * len(case.outputs)),
                             case.outputs) if is_float(op.dtype)]
  for j, (g, w, op, tol) in enumerate(zip(got, want, floats, tols)):
    g64 = np.asarray(g, np.float64)
    w64 = np.asarray(w, np.float64)
    finite = np.isfinite(w64)
    scale = max(1.0, float(np.max(np.abs(w64[finite]), initial=0.0)))
    t = 4 * max(tol, 1e-5)
    with np.errstate(invalid="ignore"):
      close = np.isclose(g64, w64, rtol=t, atol=t * scale)
    bad = (np.isnan(g64) != np.isnan(w64)) | (~np.isnan(w64) & ~close)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      return (f"jvp of out{j}: {int(bad.sum())} of {bad.size} tangent "
              f"elements differ from interpret's, first at {list(idx)}: "
              f"got {g[idx]!r}, expected {w[idx]!r}")
  return None


def _first_line(exc: BaseException) -> str:
  """The exception's first line, and its last when it wraps a traceback."""
  text = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
  head = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
  if len(text) > 1:
    head += f" ... {text[-1][:300]}"
  return head


def classify_error(case: Case, exc: BaseException, backend: str) -> Outcome:
  import dsl
  if isinstance(exc, dsl.KernelError) and case.name in str(exc):
    return Outcome("refused", _first_line(exc))
  tb = traceback.extract_tb(exc.__traceback__)
  where = f" [{tb[-1].filename.split('/')[-1]}:{tb[-1].lineno}]" if tb else ""
  if backend == ORACLE and isinstance(exc, NotImplementedError):
    return Outcome("refused", _first_line(exc) + where)  # a Pallas limitation
  return Outcome("crash", _first_line(exc) + where)


def mismatch(case: Case, got, want) -> str | None:
  """Why `got` differs from `want` (None if it does not)."""
  if len(got) != len(want):
    return f"{len(got)} outputs, expected {len(want)}"
  tols = case.param("tol", (0.0,) * len(want))
  for j, (g, w, op) in enumerate(zip(got, want, case.outputs)):
    g, w = np.asarray(g), np.asarray(w)
    if g.shape != w.shape or g.dtype != w.dtype:
      return f"out{j}: {g.dtype}{list(g.shape)}, expected {w.dtype}{list(w.shape)}"
    if not is_float(op.dtype):
      bad = g != w
    else:
      g64, w64 = g.astype(np.float64), w.astype(np.float64)
      nan_g, nan_w = np.isnan(g64), np.isnan(w64)
      finite = np.isfinite(w64)
      scale = max(1.0, float(np.max(np.abs(w64[finite]), initial=0.0)))
      with np.errstate(invalid="ignore"):
        close = np.isclose(g64, w64, rtol=tols[j], atol=tols[j] * scale)
      bad = (nan_g != nan_w) | (~nan_w & ~close)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      return (f"out{j}: {int(bad.sum())} of {bad.size} elements differ, first "
              f"at {list(idx)}: got {g[idx]!r}, expected {w[idx]!r}")
  return None


def run_one(case: Case, backend: str, want,
            tangents: dict | None = None) -> Outcome:
  """Runs `case` on `backend` against the reference's outputs `want`; for
  a case marked `jvp`, also its tangents against those of `interpret`
  (kept in `tangents`, which the interpret run fills)."""
  t0 = time.perf_counter()
  tangents = {} if tangents is None else tangents
  stage = ""
  try:
    got = run_backend(case, backend)
    if want is None:        # results that follow from what the backend drew
      want = FAMILIES[case.family].derive(case, got)
    why = mismatch(case, got, want)
    if why is None and case.param("jvp") and backend != ORACLE:
      stage = "jvp: "
      got_t = run_jvp(case, backend)
      if backend == "interpret":
        tangents["want"] = got_t
      elif "want" in tangents:
        why = jvp_mismatch(case, got_t, tangents["want"])
  except Exception as exc:  # every failure is classified, none escapes
    out = classify_error(case, exc, backend)
    out.detail = stage + out.detail
  else:
    out = Outcome("disagree", why) if why else Outcome("agree")
  out.seconds = time.perf_counter() - t0
  return out


def run_case(case: Case, backends=CPU_BACKENDS, skip_known: bool = True,
             on_start=None, crashed: dict[str, str] | None = None) -> CaseResult:
  """Runs `case` on the oracle and `backends`; `on_start(backend)` is called
  before each run (the driver records where a dying process was);
  `crashed` holds backends already known to kill the process."""
  from tests.pallas.fuzz.reference import run_reference
  result = CaseResult(case.id, case.family, sorted(case.features), {})
  t0 = time.perf_counter()
  try:
    want = None if FAMILIES[case.family].derive else run_reference(case)
  except Exception as exc:
    result.error = "reference: " + _first_line(exc)
    return result
  result.outcomes["reference"] = Outcome("ran", "",
                                         time.perf_counter() - t0)
  tangents: dict = {}
  for backend in (ORACLE,) + tuple(backends):
    if crashed and backend in crashed:
      result.outcomes[backend] = Outcome("crash", crashed[backend])
      continue
    reason = known_failure(case.features, backend) if skip_known else None
    if reason:
      result.outcomes[backend] = Outcome("skipped", reason)
      continue
    if on_start:
      on_start(backend)
    result.outcomes[backend] = run_one(case, backend, want, tangents)
  oracle = result.outcomes[ORACLE]
  if oracle.status == "disagree" and not case.features & PALLAS_DIFFERS:
    for b, o in result.outcomes.items():
      if b != ORACLE and o.status == "disagree":
        result.outcomes[b] = Outcome("unchecked", o.detail)
  return result
