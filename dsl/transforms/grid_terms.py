"""Terms over a grid step's ids, and proofs of implications between them.

A kernel's conditions (`pl.when(k == 0)`, `m_tile_ids[g] != m_tile_ids[g -
1]`) and its index maps' block indices are built here as terms: integers
are linear forms (`Lin`) over atoms (a grid id, a dynamic grid size, a read
of a scalar-prefetch ref at an index, a `select` between integers, or a value
the terms do not model); booleans are `Cmp` literals (a linear form `== 0`,
`!= 0` or `>= 0`) under `And`/`Or`, with Python's True and False. Terms are
normalized on construction (sorted atoms, one sign, no common factor), so
two reads of one prefetch element at equal indices are one atom and two
equal comparisons one literal.

`implies(hypotheses, goal)` decides what it can: True only when the goal
holds wherever every hypothesis does. It splits the hypotheses' disjunctions,
fixes the atoms an equation pins down, bounds the grid ids (by their grid
sizes and by the hypotheses), and simplifies the goal under what it learned;
anything it cannot decide is not proved.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

_INF = math.inf
_MAX_CASES = 256      # disjunctions split when proving, at most


@dataclasses.dataclass(frozen=True)
class Atom:
  """An integer the terms treat as a variable. `kind`: "id" (grid dim
  `key`), "size" (the size of dynamic grid dim `key`), "read" (prefetch
  ref `key[0]` at the linear indices `key[1]`, indexed as `key[2]`),
  "select" (`key` = (predicate, cases)), "op" (`key` = (primitive name,
  operands): a pure function of its operands) or "opaque" (a value known
  by its identity `key` only)."""
  kind: str
  key: Any

  def sort_key(self) -> str:
    return f"{self.kind}:{self.key!r}"


@dataclasses.dataclass(frozen=True)
class Lin:
  """`const + sum(c * atom for atom, c in terms)`; `terms` sorted."""
  terms: tuple = ()
  const: int = 0

  @staticmethod
  def of(atom: Atom, coeff: int = 1) -> "Lin":
    return Lin(((atom, coeff),), 0)

  @staticmethod
  def from_dict(d: dict, const: int) -> "Lin":
    items = sorted(((a, c) for a, c in d.items() if c),
                   key=lambda t: t[0].sort_key())
    return Lin(tuple(items), int(const))

  def as_dict(self) -> dict:
    return dict(self.terms)

  def __add__(self, other: "Lin") -> "Lin":
    d = self.as_dict()
    for a, c in other.terms:
      d[a] = d.get(a, 0) + c
    return Lin.from_dict(d, self.const + other.const)

  def scaled(self, k: int) -> "Lin":
    return Lin.from_dict({a: c * k for a, c in self.terms}, self.const * k)

  def __sub__(self, other: "Lin") -> "Lin":
    return self + other.scaled(-1)

  @property
  def is_const(self) -> bool:
    return not self.terms


def const(v: int) -> Lin:
  return Lin((), int(v))


@dataclasses.dataclass(frozen=True)
class Cmp:
  """`lin == 0` (op "eq"), `lin != 0` ("ne") or `lin >= 0` ("ge")."""
  op: str
  lin: Lin


@dataclasses.dataclass(frozen=True)
class And:
  items: tuple


@dataclasses.dataclass(frozen=True)
class Or:
  items: tuple


def cmp(op: str, lin: Lin):
  """The normalized literal `lin <op> 0` for op in eq/ne/ge/gt/le/lt, or
  a bool where it is decided; a lone `select` of constants compares case
  by case."""
  if op in ("gt", "le", "lt"):
    lin = {"gt": lin - const(1), "le": lin.scaled(-1),
           "lt": lin.scaled(-1) - const(1)}[op]
    op = "ge"
  if lin.is_const:
    return {"eq": lin.const == 0, "ne": lin.const != 0,
            "ge": lin.const >= 0}[op]
  by_cases = _select_cases(lin)
  if by_cases is not None:
    pred, cases = by_cases
    return disj([conj([when, cmp(op, c)]) for when, c in
                 zip(case_conditions(pred, len(cases)), cases)])
  g = math.gcd(*[c for _, c in lin.terms])
  coeffs = {a: c // g for a, c in lin.terms}
  if op == "ge":
    return Cmp("ge", Lin.from_dict(coeffs, math.floor(lin.const / g)))
  if lin.const % g:
    return op == "ne"
  if lin.terms[0][1] < 0:
    return Cmp(op, Lin.from_dict(coeffs, lin.const // g).scaled(-1))
  return Cmp(op, Lin.from_dict(coeffs, lin.const // g))


def _select_cases(lin: Lin):
  """(predicate, the linear form per case) when `lin`'s one non-constant
  atom is a `select` whose cases are constants."""
  if len(lin.terms) != 1:
    return None
  (atom, c), = lin.terms
  if atom.kind != "select":
    return None
  pred, cases = atom.key
  if not all(x.is_const for x in cases):
    return None
  return pred, [x.scaled(c) + const(lin.const) for x in cases]


def case_conditions(pred, n: int) -> list:
  """The condition under which each of `n` cases of a select on `pred` (a
  boolean term, or an integer `Lin` clamped to the cases) is taken."""
  if n == 1:
    return [True]
  if not isinstance(pred, Lin):
    if n != 2:
      raise ValueError(f"internal error: a boolean picks one of {n} cases")
    return [negate(pred), pred]
  return [cmp("le", pred) if i == 0 else
          cmp("ge", pred - const(n - 1)) if i == n - 1 else
          cmp("eq", pred - const(i)) for i in range(n)]


def select(pred, cases: list[Lin]) -> Lin:
  """The integer `cases[pred]` (a boolean `pred` picks case 1 when true)."""
  if isinstance(pred, bool):
    return cases[int(pred)]
  if isinstance(pred, Lin) and pred.is_const:
    return cases[min(max(pred.const, 0), len(cases) - 1)]
  if all(c == cases[0] for c in cases):
    return cases[0]
  return Lin.of(Atom("select", (pred, tuple(cases))))


def negate(b):
  if isinstance(b, bool):
    return not b
  if isinstance(b, Cmp):
    if b.op == "ge":
      return cmp("ge", b.lin.scaled(-1) - const(1))
    return cmp("ne" if b.op == "eq" else "eq", b.lin)
  if isinstance(b, And):
    return disj([negate(x) for x in b.items])
  return conj([negate(x) for x in b.items])


def _junction(items, kind, absorbing: bool) -> Any:
  """`kind` (And or Or) of `items`, flattened and deduplicated; the bool
  `absorbing` (False for And) where one item is it."""
  out = []
  for x in items:
    if x is absorbing:
      return absorbing
    if x is not (not absorbing):
      out.extend(x.items if isinstance(x, kind) else [x])
  out = list(dict.fromkeys(out))
  return (not absorbing) if not out else out[0] if len(out) == 1 \
      else kind(tuple(out))


def conj(items) -> Any:
  return _junction(items, And, False)


def disj(items) -> Any:
  return _junction(items, Or, True)


@dataclasses.dataclass
class Context:
  """What holds: atoms fixed to a value, bounds on atoms, true literals."""
  bounds: dict             # Atom -> (lo, hi), for the grid ids and sizes
  fixed: dict = dataclasses.field(default_factory=dict)
  facts: set = dataclasses.field(default_factory=set)

  def copy(self) -> "Context":
    return Context(dict(self.bounds), dict(self.fixed), set(self.facts))

  def interval(self, lin: Lin):
    lo = hi = lin.const
    for a, c in lin.terms:
      alo, ahi = self.bounds.get(a, _atom_range(a))
      lo, hi = (lo + c * alo, hi + c * ahi) if c > 0 else (
          lo + c * ahi, hi + c * alo)
    return lo, hi

  def learn(self, lit: Cmp) -> None:
    """Takes the simplified literal `lit` as true."""
    if len(lit.lin.terms) != 1:
      self.facts.add(lit)
      return
    (a, c), = lit.lin.terms
    lo, hi = self.bounds.get(a, _atom_range(a))
    if lit.op == "eq" and lit.lin.const % c == 0:
      self.fixed[a] = -lit.lin.const // c
    elif lit.op == "ge" and c > 0:
      self.bounds[a] = (max(lo, math.ceil(-lit.lin.const / c)), hi)
    elif lit.op == "ge":
      self.bounds[a] = (lo, min(hi, math.floor(lit.lin.const / -c)))
    elif lit.op == "ne" and c == 1 and -lit.lin.const in (lo, hi):
      v = -lit.lin.const
      self.bounds[a] = (lo + (v == lo), hi - (v == hi))
    else:
      self.facts.add(lit)


def _atom_range(a: Atom):
  if a.kind == "select":
    pred, cases = a.key
    if all(c.is_const for c in cases):
      return min(c.const for c in cases), max(c.const for c in cases)
  return -_INF, _INF


def simplify_lin(lin: Lin, ctx: Context) -> Lin:
  out = const(lin.const)
  for a, c in lin.terms:
    out = out + _simplify_atom(a, ctx).scaled(c)
  return out


def _simplify_atom(a: Atom, ctx: Context) -> Lin:
  if a in ctx.fixed:
    return const(ctx.fixed[a])
  if a.kind == "read":
    k, idx, tree = a.key
    read = Atom("read", (k, tuple(simplify_lin(i, ctx) for i in idx), tree))
    return const(ctx.fixed[read]) if read in ctx.fixed else Lin.of(read)
  if a.kind == "select":
    pred, cases = a.key
    pred = (simplify_lin(pred, ctx) if isinstance(pred, Lin)
            else simplify(pred, ctx))
    return select(pred, [simplify_lin(c, ctx) for c in cases])
  if a.kind == "op":
    name, args = a.key
    args = tuple(simplify_lin(x, ctx) for x in args)
    if name in ("max", "min") and len(args) == 2:
      lo, hi = ctx.interval(args[0] - args[1])
      first = lo >= 0 if name == "max" else hi <= 0
      second = hi <= 0 if name == "max" else lo >= 0
      if first or second:
        return args[0] if first else args[1]
    return Lin.of(Atom("op", (name, args)))
  return Lin.of(a)


def simplify(b, ctx: Context):
  """`b` with what `ctx` knows substituted and decided."""
  if isinstance(b, bool):
    return b
  if isinstance(b, And):
    return conj([simplify(x, ctx) for x in b.items])
  if isinstance(b, Or):
    return disj([simplify(x, ctx) for x in b.items])
  got = cmp(b.op, simplify_lin(b.lin, ctx))
  if not isinstance(got, Cmp):
    return simplify(got, ctx) if not isinstance(got, bool) else got
  if got in ctx.facts:
    return True
  if negate(got) in ctx.facts:
    return False
  lo, hi = ctx.interval(got.lin)
  if got.op == "ge":
    return True if lo >= 0 else False if hi < 0 else got
  if lo > 0 or hi < 0:
    return got.op == "ne"
  if lo == hi == 0:
    return got.op == "eq"
  return got


def _absorb(lits: list, ctx: Context):
  """`ctx` having learned the literals `lits`, re-simplified until they
  teach nothing more. False when they contradict each other; else None,
  or (i, s) for the first literal `i` whose simplified form `s` holds a
  disjunction to split."""
  split = None
  for _ in range(4):
    before = (dict(ctx.fixed), dict(ctx.bounds), set(ctx.facts))
    learned, split = Context(ctx.bounds, ctx.fixed, set()), None
    for i, lit in enumerate(lits):
      s = simplify(lit, learned)
      if s is False:
        return False
      parts = [] if s is True else s.items if isinstance(s, And) else [s]
      for part in parts:
        if isinstance(part, Cmp):
          learned.learn(part)
        elif split is None:
          split = (i, s)
    ctx.fixed, ctx.bounds, ctx.facts = (learned.fixed, learned.bounds,
                                        learned.facts)
    if before == (ctx.fixed, ctx.bounds, ctx.facts):
      break
  return split


def implies(hypotheses: list, goal, bounds: dict) -> bool:
  """Whether `goal` holds wherever all `hypotheses` do (`bounds`: the
  ranges of the grid ids and sizes). False where undecided."""
  budget = [_MAX_CASES]

  def prove(lits) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
      return False
    ctx = Context(dict(bounds))
    found = _absorb(lits, ctx)
    if found is False:
      return True                 # the hypotheses cannot all hold
    if found is None:
      return simplify(goal, ctx) is True
    i, s = found
    parts = list(s.items) if isinstance(s, And) else [s]
    j = next(k for k, p in enumerate(parts) if isinstance(p, Or))
    keep = lits[:i] + lits[i + 1:] + parts[:j] + parts[j + 1:]
    return all(prove(keep + [x]) for x in parts[j].items)

  return prove(list(hypotheses))
