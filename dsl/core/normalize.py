"""Rewrites kernel jaxprs into the primitives every lowering handles.

JAX's own transformations leave primitives in derived kernels (jvp, linear,
transposed and recording kernels) that a user never writes: `empty2`
allocations from scan's transpose, `one_minus_square` from tanh's derivative,
`select_n` with three or more cases, `copy`, `broadcast_to` (JAX's state
indexing broadcasts array indices with it), calls (`jit`, `eval_jaxpr`,
`custom_jvp_call`, `custom_vjp_call`), and unused zeros of dtype float0 (the
tangent type of integers), which become numpy constants. Before a kernel
goes to a compiled or host lowering (Triton, Mosaic), `normalize` re-traces
its jaxpr, replacing each primitive of `DECOMPOSITIONS` with plain lax
operations, inlining calls and recursing into the jaxprs of control flow and
`run_scoped`. Every new equation keeps the source line of the equation it
replaces.

For a lowering whose rule table has no rule for a primitive of
`dsl.core.fallbacks.FALLBACKS` (math such as `erf_inv`, `cbrt`, `atan2`),
`normalize(spec, missing=...)` also replaces its equations with the
fallback's lax operations, which that lowering's own rules then lower.
Gathers and scatters of values become the forms of `dsl.core.index_forms`;
for a lowering without a `gather` rule (`gather` in `missing`), only those
that need no gather.

Primitives not in the table pass through unchanged, so a kernel that holds
none of them comes back equal (and `normalize` returns the same spec).

For the Mosaic (TPU) lowering, `normalize(spec, values_in_memory=True)` also
rewrites strided `slice` and `pad` (interior padding too) into strided ref
reads and writes of a buffer, and `dynamic_slice` and `dynamic_update_slice` on values (what the
reverse mode of a loop over ref rows makes of `x_ref[pl.ds(i, 1), :]` once the
per-point function is discharged) into a round trip through a `run_scoped`
VMEM buffer: store the value whole, then load (or store) the window at its
dynamic start. A TPU slices and updates vectors in registers only at static
offsets, but loads and stores VMEM at dynamic offsets on its untiled and
second-minor dims, which is what these windows use; doing it here keeps one
lowering path (`run_scoped` -> `tpu.region` + `memref.alloca`, ref loads and
stores) instead of a second one inside the Mosaic rules. Starts are clamped
as `dynamic_slice` clamps them, and a dim the window covers whole gets the
static start 0: the row slices of a transposed row loop thus have static lane
offsets (a window narrower than the last dim at a traced start would need a
dynamic lane offset, which a TPU does not have).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from jax import dtypes

from jax import lax
from dsl.core.jax_internals import (close_jaxpr, ClosedJaxpr, core,
                                    lax_internal, partial_eval as pe,
                                    state_primitives, state_types)
import jax.extend.linear_util as lu

from dsl.core import fallbacks, index_forms
from dsl.core.access import slice_entry
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body, retrace, sub_jaxprs
from dsl.core.memory import MemorySpace
from dsl.core.primitives import run_scoped

# primitive -> fn(*operands, **params) -> result(s), written with lax ops.
DECOMPOSITIONS: dict[Any, Callable] = {}


def _decomposes(*primitives):
  def register(fn):
    for p in primitives:
      DECOMPOSITIONS[p] = fn
    return fn
  return register


@_decomposes(lax_internal.empty_p)
def _empty(*, shape, dtype, out_sharding=None):
  return lax.full(shape, 0, dtype)


@_decomposes(lax_internal.empty2_p)
def _empty2(*, dtype, memory_space=None):
  return lax.full((), 0, dtype)


@_decomposes(lax_internal.one_minus_square_p)
def _one_minus_square(x):
  return lax.sub(lax.full_like(x, 1), lax.mul(x, x))


@_decomposes(lax_internal.copy_p)
def _copy(x):
  return x


@_decomposes(state_primitives.broadcast_to_p)
def _broadcast_to(x, *, shape):
  # JAX's state indexing broadcasts array indices with it (`x_ref.at[rows[:,
  # None], cols[None]]`).
  return jnp.broadcast_to(x, shape)


@_decomposes(lax.select_n_p)
def _select_n(which, *cases):
  """`select_n` with a boolean or two cases stays; more cases become a
  binary tree of two-case selects on the bits of `which`."""
  if len(cases) <= 2:
    return lax.select_n(which, *cases)
  half = 1 << (len(cases) - 1).bit_length() - 1
  low = _select_n(which, *cases[:half])
  rest = cases[half:]
  shifted = lax.sub(which, lax.full_like(which, half))
  high = rest[0] if len(rest) == 1 else _select_n(
      lax.max(shifted, lax.full_like(shifted, 0)), *rest)
  return lax.select(lax.lt(which, lax.full_like(which, half)), low, high)


# Rewrites used only where vectors cannot be sliced at dynamic offsets (Mosaic).
VALUES_IN_MEMORY: dict[Any, Callable] = {}


def _window(shape, starts, sizes):
  """The ref indexer of a `dynamic_slice` window, starts clamped as
  `dynamic_slice` clamps them; whole dims get the static start 0."""
  index = []
  for dim, start, size in zip(shape, starts, sizes):
    if size == dim:
      index.append(slice_entry(0, size))
      continue
    start = lax.convert_element_type(start, np.int32)
    start = lax.clamp(np.int32(0), start, np.int32(dim - size))
    index.append(slice_entry(start, size))
  return tuple(index)


def _dynamic_slice(x, *starts, slice_sizes):
  def scoped(ref):
    ref[...] = x
    return ref[_window(x.shape, starts, slice_sizes)]
  return run_scoped(scoped, _buffer(x.shape, x.dtype))


def _dynamic_update_slice(x, update, *starts):
  def scoped(ref):
    ref[...] = x
    ref[_window(x.shape, starts, update.shape)] = update
    return ref[...]
  return run_scoped(scoped, _buffer(x.shape, x.dtype))


VALUES_IN_MEMORY[lax.dynamic_slice_p] = _dynamic_slice
VALUES_IN_MEMORY[lax.dynamic_update_slice_p] = _dynamic_update_slice


def _slice(x, *, start_indices, limit_indices, strides):
  """A strided `slice` of a value (what reverse mode makes of a strided ref
  read, and `associative_scan` of a cumulative op) as a buffer round trip:
  store `x` whole, load the window with a strided ref read. Unit strides
  stay a `slice`."""
  if strides is None or all(s == 1 for s in strides):
    return lax.slice_p.bind(x, start_indices=start_indices,
                            limit_indices=limit_indices, strides=strides)
  sizes = [max(0, -(-(l - s) // st))
           for s, l, st in zip(start_indices, limit_indices, strides)]
  if 0 in sizes:      # an empty result: any window of its shape will do
    return lax.slice(x, [0] * x.ndim, sizes)
  window = tuple(slice_entry(s, n, st)
                 for s, n, st in zip(start_indices, sizes, strides))

  def scoped(ref):
    ref[...] = x
    return ref[window]
  return run_scoped(scoped, _buffer(x.shape, x.dtype))


VALUES_IN_MEMORY[lax.slice_p] = _slice


def _pad(x, padding_value, *, padding_config):
  """`lax.pad` (the transpose of a slice; with interior padding, of a
  strided one) as a buffer round trip: fill with the padding value, store
  `x` (trimmed where a padding is negative) at its static offsets, with a
  strided ref write where the padding is interior."""
  if any(interior and l < 0 for l, _, interior in padding_config):
    # Trimming into the interior padding has no strided window; a lowering
    # that cannot lower the pad says so.
    return lax.pad_p.bind(x, padding_value, padding_config=padding_config)
  lo = [max(0, -l) for l, _, _ in padding_config]
  spread = [(n - 1) * (i + 1) + 1 if n else 0
            for n, (_, _, i) in zip(x.shape, padding_config)]
  cut = [max(0, -h) for _, h, _ in padding_config]
  keep = [max(0, -(-(m - c - t) // (i + 1)))
          for m, c, t, (_, _, i) in zip(spread, cut, lo, padding_config)]
  x = lax.slice(x, lo, [t + k for t, k in zip(lo, keep)])
  shape = tuple(m + l + h for m, (l, h, _) in zip(spread, padding_config))
  window = tuple(slice_entry(max(0, l), n, i + 1)
                 for n, (l, _, i) in zip(x.shape, padding_config))

  def scoped(ref):
    ref[...] = lax.full(shape, padding_value, x.dtype)
    ref[window] = x
    return ref[...]
  return run_scoped(scoped, _buffer(shape, x.dtype))


VALUES_IN_MEMORY[lax.pad_p] = _pad


# The combine of each cumulative reduction, for Mosaic (which has no scan
# along a vector dim).
_CUMULATIVE_COMBINE = {lax.cumsum_p: lax.add, lax.cumprod_p: lax.mul,
                       lax.cummax_p: lax.max, lax.cummin_p: lax.min,
                       lax.cumlogsumexp_p: jnp.logaddexp}


def _cumulative(primitive, pad):
  """A scan in log2(n) steps of shift and combine: after step `k` each lane
  holds the combine of the `2k` lanes up to it. Shifts are pads and unit
  slices (no zero-size or strided values, which a TPU does not have)."""
  combine = _CUMULATIVE_COMBINE[primitive]

  def rule(x, *, axis, reverse):
    n = x.shape[axis]
    lane = lax.broadcasted_iota(np.int32, x.shape, axis)
    if reverse:
      lane = np.int32(n - 1) - lane
    k = 1
    while k < n:
      pads = [(0, 0, 0)] * x.ndim
      pads[axis] = (0, k, 0) if reverse else (k, 0, 0)
      wide = pad(x, lax.full((), 0, x.dtype), padding_config=tuple(pads))
      start = [0] * x.ndim
      start[axis] = k if reverse else 0
      shifted = lax.slice(wide, start, [s + d for s, d in zip(start, x.shape)])
      x = lax.select(lane >= k, combine(x, shifted), x)
      k *= 2
    return x
  return rule


for _p in _CUMULATIVE_COMBINE:
  VALUES_IN_MEMORY[_p] = _cumulative(_p, _pad)

# What the derivation of a kernel differentiates in place of the nonlinear
# cumulative reductions: JAX's jvp of these goes through `associative_scan`,
# whose zero-size and strided intermediate values a TPU does not have.
# (cumsum is linear: its jvp is a cumsum.)
SCANS_TO_DIFFERENTIATE = {
    p: _cumulative(p, lax.pad_p.bind)
    for p in (lax.cummax_p, lax.cummin_p, lax.cumprod_p,
              lax.cumlogsumexp_p)}


def scan_layout(params: dict) -> tuple[int, int, int, int]:
  """(consts, carry, xs, ys) counts of a scan equation."""
  n_consts, n_carry, n_xs = (len(p) for p in params["ft_in"].unpack())
  return n_consts, n_carry, n_xs, len(params["ft_out"].unpack()[1])


@_decomposes(lax.scan_p)
def _scan(*args, jaxpr, length, reverse, **params):
  """A scan over stacked arrays (what JAX's transposition makes of a loop
  with per-iteration residuals) becomes a loop over refs: xs and ys live in
  `run_scoped` buffers indexed by the iteration. Scans without xs/ys (what
  `fori_loop` makes) stay scans."""
  n_consts, n_carry, n_xs, n_ys = scan_layout(params)
  body = normalize_closed(jaxpr)
  if not n_xs and not n_ys:
    return lax.scan_p.bind(*args, jaxpr=body, length=length, reverse=reverse,
                           **params)
  consts = list(args[:n_consts])
  init = list(args[n_consts:n_consts + n_carry])
  xs = list(args[n_consts + n_carry:])
  buffers = ([_buffer(x.shape, x.dtype) for x in xs] +
             [_buffer((length, *a.shape), a.dtype)
              for a in body.out_avals[n_carry:]])

  def scoped(*refs):
    xs_refs, ys_refs = refs[:n_xs], refs[n_xs:]
    for ref, x in zip(xs_refs, xs):
      ref[...] = x

    def step(k, carry):
      i = (length - 1 - k) if reverse else k
      outs = core.jaxpr_as_fun(body)(*consts, *carry,
                                     *[ref[i] for ref in xs_refs])
      for ref, y in zip(ys_refs, outs[n_carry:]):
        ref[i] = y
      return list(outs[:n_carry])

    carry = lax.fori_loop(0, length, step, init)
    return list(carry) + [ref[...] for ref in ys_refs]

  return run_scoped(scoped, *buffers)


def _buffer(shape, dtype):
  return state_types.AbstractRef(core.ShapedArray(tuple(shape), dtype),
                                 memory_space=MemorySpace.VMEM)


def _sub_jaxpr_params(params: dict) -> bool:
  return any(True for _ in sub_jaxprs(params))


def _normalized_param(value):
  if isinstance(value, ClosedJaxpr):
    return normalize_closed(value)
  if isinstance(value, core.Jaxpr):
    closed = normalize_closed(close_jaxpr(value, ()))
    if closed.consts:
      return None          # an open jaxpr must stay closed over nothing
    return closed.jaxpr
  if isinstance(value, tuple) and value and isinstance(
      value[0], (core.Jaxpr, ClosedJaxpr)):
    new = tuple(_normalized_param(v) for v in value)
    return None if any(v is None for v in new) else new
  return value


def _own_effects(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with the effects of its own equations only."""
  j = closed.jaxpr
  effs = pe.make_jaxpr_effects(j.constvars, j.invars, j.outvars, j.eqns)
  return ClosedJaxpr(core.replace_jaxpr_effects(j, effs), closed.consts)


def _rejoin_branch_effects(params: dict) -> dict:
  """`lax.cond` gives each branch the effects of all of them (a ref read in
  one branch is an effect of every branch). A rewrite that drops an effect
  (a read made pure) leaves it on the branches it did not retrace: recompute
  each branch's effects and join them again, as `lax.cond` does."""
  own = [_own_effects(b) for b in params["branches"]]
  joined = core.join_effects(*(core.positional_effects(b.jaxpr) for b in own))
  branches = tuple(ClosedJaxpr(core.replace_jaxpr_effects(
      b.jaxpr, core.resolve_input_effects(joined, b.jaxpr.invars)), b.consts)
      for b in own)
  return dict(params, branches=branches)


# primitive -> fn(params) -> params: what a rewrite of the sub-jaxprs of an
# equation of that primitive must also redo.
_AFTER_REWRITE = {lax.cond_p: _rejoin_branch_effects}


def _bind(eqn, invals):
  params = eqn.params
  if _sub_jaxpr_params(params):
    new = {k: _normalized_param(v) for k, v in params.items()}
    if all(v is not None for v in new.values()):
      params = new
      if eqn.primitive in _AFTER_REWRITE:
        params = _AFTER_REWRITE[eqn.primitive](params)
  return eqn.primitive.bind(*invals, **params)


def _makes_float0(eqn) -> bool:
  """An equation that makes only values of dtype float0 (the tangent type
  of integers: zeros that JAX's transformations leave in derived kernels,
  unused). No lowering has a type for them: they become numpy constants."""
  return (bool(eqn.outvars) and not eqn.effects
          and all(getattr(v.aval, "dtype", None) == dtypes.float0
                  for v in eqn.outvars))


def _float0_constants(eqn):
  outs = [np.zeros(v.aval.shape, dtypes.float0) for v in eqn.outvars]
  return outs if eqn.primitive.multiple_results else outs[0]


def _eval_eqn(eqn, invals, scope: index_forms.Scope):
  if _makes_float0(eqn):
    return _float0_constants(eqn)
  if eqn.primitive in CALL_PRIMITIVES:
    body = call_body(eqn.params, invals)
    return _eval(*body) if body is not None else _bind(eqn, invals)
  if eqn.primitive in _RULES.get():
    return _RULES.get()[eqn.primitive](*invals, **eqn.params)
  if _falls_back(eqn):
    return fallbacks.FALLBACKS[eqn.primitive].fn(*invals, **eqn.params)
  form = _index_form(scope, eqn)
  if form is not None:
    return index_forms.rewrite(scope, eqn, form, invals)
  return _bind(eqn, invals)


def _eval(jaxpr: core.Jaxpr, consts, args) -> list:
  scope = index_forms.Scope(jaxpr, consts, args)

  def eval_eqn(eqn, invals):
    outs = _eval_eqn(eqn, invals, scope)
    scope.record(eqn, outs)
    return outs
  return retrace(jaxpr, consts, args, eval_eqn)


def _index_form(scope: index_forms.Scope, eqn):
  """What rewriting a gather or scatter into the forms the lowerings
  handle needs (dsl.core.index_forms), or None; only when normalizing, and
  into forms without a gather where the lowering has no gather rule."""
  if not _INDEX_FORMS.get():
    return None
  return index_forms.form(scope, eqn,
                          gathers=lax.gather_p not in _FALLBACKS.get())


def needs_normalizing(jaxpr: core.Jaxpr) -> bool:
  scope = index_forms.Scope(jaxpr)
  return any(_rewritten(eqn, scope) or eqn.primitive in CALL_PRIMITIVES
             or any(needs_normalizing(j) for j in sub_jaxprs(eqn.params))
             for eqn in jaxpr.eqns)


def _rewritten(eqn, scope: index_forms.Scope) -> bool:
  if _makes_float0(eqn) or _index_form(scope, eqn) is not None:
    return True
  if eqn.primitive is lax.scan_p:
    _, _, n_xs, n_ys = scan_layout(eqn.params)
    return bool(n_xs or n_ys)
  if eqn.primitive is lax.select_n_p:
    return len(eqn.invars) > 3
  if eqn.primitive is lax.slice_p:
    strides = eqn.params["strides"]
    return strides is not None and any(s != 1 for s in strides) and (
        eqn.primitive in _RULES.get())
  return eqn.primitive in _RULES.get() or _falls_back(eqn)


# The rewrites in force: DECOMPOSITIONS, plus VALUES_IN_MEMORY for Mosaic.
_RULES = contextvars.ContextVar("normalize_rules", default=DECOMPOSITIONS)
# The primitives the lowering's rule table has no rule for (`missing`): those
# of dsl.core.fallbacks are replaced by their fallback; without `gather`,
# gathers and scatters get only the index forms that need none.
_FALLBACKS = contextvars.ContextVar("normalize_fallbacks",
                                    default=frozenset())
# Whether gathers and scatters become the forms the lowerings handle (not
# in `rewrite_closed`, which rewrites only what it is given).
_INDEX_FORMS = contextvars.ContextVar("normalize_index_forms", default=True)


def _falls_back(eqn) -> bool:
  return fallbacks.applies(eqn.primitive, [v.aval for v in eqn.invars],
                           _FALLBACKS.get())


def _holds_fallback(jaxpr: core.Jaxpr) -> bool:
  return any(_falls_back(eqn)
             or any(_holds_fallback(j) for j in sub_jaxprs(eqn.params))
             for eqn in jaxpr.eqns)


def missing(rules) -> frozenset:
  """The primitives `normalize(spec, missing=...)` is told a lowering whose
  rule table is `rules` (`p in rules` asks it) has no rule for: those of
  `dsl.core.fallbacks.FALLBACKS`, and `gather`."""
  return fallbacks.missing(rules) | frozenset(
      p for p in (lax.gather_p,) if p not in rules)


@contextlib.contextmanager
def _rules_in_force(rules: dict):
  token = _RULES.set(rules)
  try:
    yield
  finally:
    _RULES.reset(token)


def _rules(values_in_memory: bool):
  return _rules_in_force({**DECOMPOSITIONS, **VALUES_IN_MEMORY}
                         if values_in_memory else DECOMPOSITIONS)


def _holds(jaxpr: core.Jaxpr, primitives) -> bool:
  return any(eqn.primitive in primitives
             or any(_holds(j, primitives) for j in sub_jaxprs(eqn.params))
             for eqn in jaxpr.eqns)


def rewrite_closed(closed: ClosedJaxpr, rules: dict) -> ClosedJaxpr:
  """`closed` with each equation of a primitive of `rules` (primitive ->
  fn(*operands, **params)) replaced by its rule, in control flow and calls
  too, and nothing else rewritten (calls are inlined); `closed` itself when
  it holds none."""
  if not _holds(closed.jaxpr, rules):
    return closed
  token = _INDEX_FORMS.set(False)
  try:
    with _rules_in_force(rules):
      fn = lu.wrap_init(lambda *args: _eval(closed.jaxpr, closed.consts,
                                            args),
                        debug_info=closed.jaxpr.debug_info)
      jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
          fn, [v.aval for v in closed.jaxpr.invars])
  finally:
    _INDEX_FORMS.reset(token)
  return close_jaxpr(jaxpr, consts)


def normalize_closed(closed: ClosedJaxpr, *,
                     values_in_memory: bool | None = None,
                     missing: frozenset | None = None) -> ClosedJaxpr:
  """`closed` rewritten; `values_in_memory` (default: as the enclosing call)
  also rewrites slices of values into buffer round trips; `missing` (default:
  as the enclosing call) are the primitives replaced by their fallback."""
  if missing is not None:
    token = _FALLBACKS.set(missing)
    try:
      return normalize_closed(closed, values_in_memory=values_in_memory)
    finally:
      _FALLBACKS.reset(token)
  if values_in_memory is not None:
    with _rules(values_in_memory):
      return normalize_closed(closed)
  # A fallback may emit another fallback's primitive (erf_inv -> log1p):
  # each pass replaces the ones it finds, and fallbacks do not cycle.
  for _ in range(len(fallbacks.FALLBACKS) + 1):
    if not needs_normalizing(closed.jaxpr):
      return closed
    fn = lu.wrap_init(lambda *args: _eval(closed.jaxpr, closed.consts, args),
                      debug_info=closed.jaxpr.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
        fn, [v.aval for v in closed.jaxpr.invars])
    closed = close_jaxpr(jaxpr, consts)
    if not _holds_fallback(closed.jaxpr):
      return closed
  return closed


@functools.lru_cache(maxsize=256)
def normalize(spec, values_in_memory: bool = False,
              missing: frozenset = frozenset()):
  """`spec` with its kernel jaxpr in the primitives every lowering handles;
  `values_in_memory` for lowerings that cannot slice vectors at dynamic
  offsets (Mosaic); `missing`: the primitives the lowering has no rule for,
  replaced by their fallback (dsl.core.fallbacks)."""
  jaxpr = normalize_closed(spec.jaxpr, values_in_memory=values_in_memory,
                           missing=missing)
  if jaxpr is spec.jaxpr:
    return spec
  return dataclasses.replace(spec, jaxpr=jaxpr)
