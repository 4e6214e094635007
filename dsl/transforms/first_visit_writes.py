"""Proof that a kernel writes an output block whole at each first visit.

A TPU starts an output block's buffer stale whenever the block index
changes, so a kernel that reads an aliased output (megablox's `gmm` with
`existing_out`) writes the block itself at the first step of each run of
visits, under a condition such as `pl.when(k == 0)` and `pl.when((g == 0) |
(m_tile_ids[g] != m_tile_ids[g - 1]))`. Where that holds, the block the
kernel reads is one it wrote, and dsl's copy-in of the aliased input
(dsl/transforms/aliased_reads.py) is not needed.

`written_at_first_visits` proves it, soundly and for any kernel:

- The body is walked in order, with the condition (`pc`) under which each
  equation runs (the `cond`s around it) and the condition (`written`) under
  which the output ref has been written whole so far (a store of all of it
  whose old value is unused). Each other use of the ref (a load, a partial
  store, an accumulate, a loop or DMA on it) must come after a write at a
  first visit: `first ∧ pc ⇒ written`; and the step must have written the
  block by its end (later steps of the run may read what it holds).
- A first visit is the first grid step, or a step whose block index
  differs from the previous step's in grid order (row-major). Stepping back
  borrows at one grid dim `d`: the ids after `d` are 0 at the step and last
  at the previous one, id `d` is one more. A dim that may be split over
  cores (declared "parallel", or added by vmap) starts a run of steps
  anywhere, so there the block need not differ.
- Conditions, block indices and grid sizes are terms over the grid ids
  (dsl/transforms/grid_terms.py), with reads of scalar prefetch as atoms
  (the kernel must not write its prefetch refs; index arithmetic is taken
  not to overflow), and each implication is decided per case. What
  cannot be decided is not proved, and the copy-in stays.
"""
from __future__ import annotations

import itertools

import numpy as np

from dsl.core.dynamic_grid import is_dynamic
from dsl.core.grid_plan import declared_semantics, full_write, written_prefetch
from dsl.core.jax_internals import core
from dsl.core.operand_layout import eqn_ref_operands
from dsl.transforms import grid_terms as T

_CALLS = ("pjit", "jit", "closed_call")
_EVALUATIONS = itertools.count()    # tells apart the atoms of evaluations


class _Prefetch:
  """The scalar-prefetch ref `k` as a value."""

  def __init__(self, k: int):
    self.k = k


def _is_int(aval) -> bool:
  return (getattr(aval, "shape", None) == ()
          and np.issubdtype(aval.dtype, np.integer))


def _is_bool(aval) -> bool:
  return getattr(aval, "shape", None) == () and aval.dtype == np.bool_


def _lins(*xs) -> bool:
  return all(isinstance(x, T.Lin) for x in xs)


def _bools(*xs) -> bool:
  return all(isinstance(x, (bool, T.Cmp, T.And, T.Or)) for x in xs)


def _comparison(op):
  def rule(eqn, a, b):
    if _lins(a, b):
      return T.cmp(op, a - b)
    if op in ("eq", "ne") and _bools(a, b):
      same = T.disj([T.conj([a, b]), T.conj([T.negate(a), T.negate(b)])])
      return same if op == "eq" else T.negate(same)
    return None
  return rule


def _logic(combine):
  def rule(eqn, *xs):
    return combine(list(xs)) if _bools(*xs) else None
  return rule


def _add(eqn, a, b):
  return a + b if _lins(a, b) else None


def _sub(eqn, a, b):
  return a - b if _lins(a, b) else None


def _neg(eqn, a):
  return a.scaled(-1) if _lins(a) else None


def _not(eqn, a):
  return T.negate(a) if _bools(a) else None


def _mul(eqn, a, b):
  if not _lins(a, b):
    return None
  if a.is_const or b.is_const:
    return b.scaled(a.const) if a.is_const else a.scaled(b.const)
  return _op(eqn, *sorted([a, b], key=repr))


def _op(eqn, *xs):
  """A pure integer function of integer operands: equal where they are."""
  if not _lins(*xs):
    return None
  return T.Lin.of(T.Atom("op", (eqn.primitive.name, tuple(xs))))


def _select_n(eqn, pred, *cases):
  if _lins(*cases) and (_bools(pred) or _lins(pred)):
    return T.select(pred, list(cases))
  if _bools(pred, *cases) and len(cases) == 2:
    return T.disj([T.conj([T.negate(pred), cases[0]]),
                   T.conj([pred, cases[1]])])
  return None


def _convert(eqn, x):
  out = eqn.outvars[0].aval
  if _bools(x) and _is_int(out):
    return T.select(x, [T.const(0), T.const(1)])
  if _lins(x) and _is_int(out):
    wide = np.iinfo(out.dtype), np.iinfo(eqn.invars[0].aval.dtype)
    return x if wide[0].min <= wide[1].min and wide[0].max >= wide[1].max \
        else _op(eqn, x)
  if _lins(x) and _is_bool(out):
    return T.cmp("ne", x)
  return x if _bools(x) and _is_bool(out) else None


def _get(eqn, ref, *rest):
  ops = eqn_ref_operands(eqn)
  leaves = rest[ops.first_leaf - 1:][:len(ops.leaves)]
  if (not isinstance(ref, _Prefetch) or not _is_int(eqn.outvars[0].aval)
      or not _lins(*leaves)):
    return None
  return T.Lin.of(T.Atom("read", (ref.k, tuple(leaves), ops.tree)))


# primitive name -> rule(eqn, *operand terms) -> the output's term or None
_RULES = {
    **{op: _comparison(op) for op in ("eq", "ne", "lt", "le", "gt", "ge")},
    "and": _logic(T.conj), "or": _logic(T.disj), "not": _not,
    "add": _add, "sub": _sub, "neg": _neg, "mul": _mul,
    "div": _op, "rem": _op, "max": _op, "min": _op,
    "select_n": _select_n, "convert_element_type": _convert, "get": _get,
}


class _Terms:
  """Evaluates jaxprs on terms. Values it does not model become atoms known
  by their identity (the variable and this evaluation), so two evaluations
  (a block index at two steps) never share one."""

  def __init__(self, sizes):
    self.sizes = sizes       # a term per grid dim
    self.tag = next(_EVALUATIONS)

  def value(self, env, v):
    if isinstance(v, core.Literal):
      if _is_bool(v.aval):
        return bool(v.val)
      return T.const(int(v.val)) if _is_int(v.aval) else None
    return env.get(v)

  def opaque(self, v):
    atom = T.Lin.of(T.Atom("opaque", (self.tag, id(v))))
    if _is_int(v.aval):
      return atom
    return T.cmp("ne", atom) if _is_bool(v.aval) else None

  def equation(self, eqn, env) -> None:
    """Binds `eqn`'s outputs in `env`."""
    ins = [self.value(env, v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CALLS:
      called = eqn.params["jaxpr"]
      outs = self.run(getattr(called, "jaxpr", called), ins,
                      getattr(called, "consts", ()))
    elif name == "num_programs":
      outs = [self.sizes[eqn.params["axis"]]]
    elif name in _RULES:
      outs = [_RULES[name](eqn, *ins)]
    else:
      outs = [None] * len(eqn.outvars)
    for v, x in zip(eqn.outvars, outs):
      env[v] = self.opaque(v) if x is None else x

  def run(self, jaxpr, args, consts=()):
    env = {v: _const_term(x) for v, x in zip(jaxpr.constvars, consts)}
    env.update((v, x) for v, x in zip(jaxpr.invars, args) if x is not None)
    for eqn in jaxpr.eqns:
      self.equation(eqn, env)
    return [self.value(env, v) for v in jaxpr.outvars]


def _const_term(x):
  if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer):
    return T.const(int(x))
  return None


class _Walk:
  """The uses of one ref in a kernel body: (pc, written) per use."""

  def __init__(self, terms: _Terms):
    self.terms = terms
    self.written = False
    self.uses = []

  def run(self, jaxpr, env, refs, pc) -> None:
    used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    for eqn in jaxpr.eqns:
      mine = [v for v in eqn.invars if isinstance(v, core.Var) and v in refs]
      name = eqn.primitive.name
      if mine and full_write(eqn, mine[0], used) and len(mine) == 1:
        self.written = T.disj([self.written, pc])
      elif mine and name == "cond":
        self._cond(eqn, env, refs, pc)
      elif mine and name in _CALLS:
        called = eqn.params["jaxpr"]
        inner = getattr(called, "jaxpr", called)
        self._enter(inner, eqn.invars, env, refs, pc)
      elif mine:
        self.uses.append((pc, self.written))
      self.terms.equation(eqn, env)

  def _enter(self, inner, operands, env, refs, pc):
    env_in = {}
    for v, x in zip(inner.invars, operands):
      val = self.terms.value(env, x)
      if val is not None:
        env_in[v] = val
    inner_refs = {v for v, x in zip(inner.invars, operands)
                  if isinstance(x, core.Var) and x in refs}
    self.run(inner, env_in, inner_refs, pc)

  def _cond(self, eqn, env, refs, pc):
    branches = eqn.params["branches"]
    index = self.terms.value(env, eqn.invars[0])
    if not isinstance(index, T.Lin):
      index = self.terms.opaque(eqn.invars[0])
    for branch, taken in zip(branches,
                             T.case_conditions(index, len(branches))):
      self._enter(branch.jaxpr, eqn.invars[1:], env, refs,
                  T.conj([pc, taken]))


def _grid_terms(gm):
  """(a term per grid id, the last id per dim, the bounds of the ids and
  dynamic sizes)."""
  ids, last, bounds, sizes = [], [], {}, []
  for d, size in enumerate(gm.grid):
    atom = T.Atom("id", d)
    ids.append(T.Lin.of(atom))
    if is_dynamic(size):
      n = T.Atom("size", d)
      bounds[n] = (1, np.inf)
      sizes.append(T.Lin.of(n))
      bounds[atom] = (0, np.inf)
    else:
      sizes.append(T.const(size))
      bounds[atom] = (0, size - 1)
    last.append(sizes[-1] - T.const(1))
  return ids, last, bounds, sizes


def _split_dims(spec) -> set[int]:
  """The grid dims whose steps may be split over cores, each part run in
  order from its own start: declared other than "arbitrary", or added by
  vmap."""
  gm = spec.grid_mapping
  sem = declared_semantics(spec.compiler_params, len(gm.grid),
                           gm.num_hidden_axes)
  hidden = set(range(gm.num_hidden_axes))
  if sem is None:
    return hidden
  return hidden | {d for d, s in enumerate(sem) if s != "arbitrary"}


def first_visit_cases(spec, o: int, grid):
  """What is known at a first visit of output `o`'s block, one list of
  hypotheses per way of stepping back to the previous step (the first
  step; a borrow at each dim). `grid`: `_grid_terms`. None where the
  block index cannot be built."""
  gm = spec.grid_mapping
  ids, last, _, sizes = grid
  prefetch = [_Prefetch(k) for k in range(gm.num_scalar_prefetch)]
  imap = gm.out_mappings[o].index_map_jaxpr

  def block(at):
    return _Terms(sizes).run(imap.jaxpr, [*at, *prefetch], imap.consts)
  now = block(ids)
  if not all(isinstance(x, T.Lin) for x in now):
    return None
  cases = [[T.cmp("eq", i) for i in ids]]
  split = _split_dims(spec)
  for d, size in enumerate(gm.grid):
    if not is_dynamic(size) and size <= 1:
      continue
    case = [T.cmp("eq", i) for i in ids[d + 1:]]
    case.append(T.cmp("ge", ids[d] - T.const(1)))
    if d not in split:
      before = block(ids[:d] + [ids[d] - T.const(1)] + last[d + 1:])
      if not all(isinstance(x, T.Lin) for x in before):
        return None
      case.append(T.disj([T.cmp("ne", a - b) for a, b in zip(now, before)]))
    cases.append(case)
  return cases


def written_at_first_visits(spec, o: int) -> bool:
  """Whether the kernel provably writes output `o`'s block whole at each
  first visit of it, before any other use of it (module docstring)."""
  gm = spec.grid_mapping
  n_grid = len(gm.grid)
  if any(written_prefetch(spec.jaxpr, n_grid, gm.num_scalar_prefetch)):
    return False
  grid = _grid_terms(gm)
  cases = first_visit_cases(spec, o, grid)
  if cases is None:
    return False
  ids, _, bounds, sizes = grid
  jaxpr = spec.jaxpr.jaxpr
  env = dict(zip(jaxpr.invars, ids))
  pf_vars = jaxpr.invars[n_grid:n_grid + gm.num_scalar_prefetch]
  env.update((v, _Prefetch(k)) for k, v in enumerate(pf_vars))
  env.update((v, _const_term(x))
             for v, x in zip(jaxpr.constvars, spec.jaxpr.consts)
             if _const_term(x) is not None)
  out_ref = gm.split(jaxpr.invars).outputs[o]
  walk = _Walk(_Terms(sizes))
  walk.run(jaxpr, env, {out_ref}, True)
  checks = walk.uses + [(True, walk.written)]
  return all(T.implies([*case, pc], written, bounds)
             for pc, written in checks for case in cases)
