"""Shrinks a failing case: simpler expressions, fewer outputs, a plain body,
as long as the backend still fails the same way.

Greedy: each round tries every one-step simplification and keeps the first
that still fails; it stops when none does (or after `budget` runs).
"""
from __future__ import annotations

import dataclasses

from tests.pallas.fuzz.expr import Expr
from tests.pallas.fuzz.runner import ORACLE, run_one
from tests.pallas.fuzz.spec import Case, is_float


def _simpler_nodes(e: Expr):
  """One-step simplifications of `e`: a child of the same dtype and shape,
  or a constant of its dtype (broadcast to its shape)."""
  if e.op in ("leaf", "const"):
    return
  for a in e.args:
    if a.dtype == e.dtype and a.shape == e.shape:
      yield a
  value = 1.0 if is_float(e.dtype) else (True if e.dtype == "bool" else 1)
  const = Expr("const", (), value, (), e.dtype, True)
  yield const if e.shape == () else Expr("bcast", (const,), None, e.shape,
                                        e.dtype, True)


def _rewrites(e: Expr):
  """`e` with one node (anywhere in it) simplified."""
  yield from _simpler_nodes(e)
  for k, a in enumerate(e.args):
    for b in _rewrites(a):
      args = e.args[:k] + (b,) + e.args[k + 1:]
      yield dataclasses.replace(e, args=args,
                                exact=e.exact and b.exact)


def _with_body(case: Case, **changes) -> Case:
  body = dict(case.body)
  body.update(changes)
  return dataclasses.replace(case, body=tuple(body.items()))


def candidates(case: Case):
  body = dict(case.body)
  if case.family == "map":
    if body.get("mode") != "plain":
      yield _with_body(case, mode="plain")
    if body.get("rows"):
      yield _with_body(case, rows=())
    if len(case.outputs) > 1:
      yield _drop_outputs(case)
  if body.get("epilogue") is not None:
    yield _with_body(case, epilogue=None)
  for key, value in body.items():
    if isinstance(value, Expr):
      for e in _rewrites(value):
        yield _with_body(case, **{key: e})
    elif isinstance(value, tuple) and value and all(isinstance(v, Expr)
                                                    for v in value):
      for k, v in enumerate(value):
        for e in _rewrites(v):
          yield _with_body(case, **{key: value[:k] + (e,) + value[k + 1:]})


def _drop_outputs(case: Case) -> Case:
  body = dict(case.body)
  body["exprs"] = body["exprs"][:1]
  body["tol"] = body["tol"][:1]
  return dataclasses.replace(case, outputs=case.outputs[:1],
                             body=tuple(body.items()))


def _fails(case: Case, backend: str, status: str) -> bool:
  from tests.pallas.fuzz.reference import run_reference
  try:
    want = run_reference(case)
  except Exception:
    return False
  return run_one(case, backend, want).status == status


def minimize(case: Case, backend: str, budget: int = 200, log=print) -> Case:
  """The smallest case found on which `backend` still fails as on `case`."""
  from tests.pallas.fuzz.reference import run_reference
  want = run_reference(case)
  status = run_one(case, backend, want).status
  if status not in ("disagree", "crash"):
    raise ValueError(f"{backend} does not fail on case {case.id} ({status})")
  runs, changed = 0, True
  while changed and runs < budget:
    changed = False
    for cand in candidates(case):
      runs += 1
      if _fails(cand, backend, status):
        case, changed = cand, True
        log(f"  [{runs}] smaller case still fails")
        break
      if runs >= budget:
        break
  oracle = run_one(case, ORACLE, run_reference(case))
  log(f"  Pallas on the minimized case: {oracle.status} {oracle.detail}")
  return case

