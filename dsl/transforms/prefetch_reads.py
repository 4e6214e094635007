"""Reads of scalar-prefetch refs as pure operations, for the linearization.

The transposed kernel keeps its scalar-prefetch refs as refs (read a scalar
at a time, as SMEM must be), so the per-point function it linearizes still
reads refs. JAX cannot partially evaluate a `cond` (a `pl.when`) whose branch
has a ref effect, which `jax.linear_transpose` needs. Prefetch refs are never
written by a derived kernel, so their reads are pure: `pure_reads` turns each
`get` of the per-point function into `prefetch_read` (the same read, with no
effect) for the linearization, and `restore_reads` turns them back into
`get`s in the traced kernel, which every lowering handles.
"""
from __future__ import annotations

from dsl.core.jax_internals import ad, core, state_primitives
from dsl.core.normalize import rewrite_closed

prefetch_read_p = core.Primitive("prefetch_read")


@prefetch_read_p.def_abstract_eval
def _abstract_eval(ref, *idx, tree):
  out = state_primitives.get_p.abstract_eval(ref, *idx, tree=tree)
  return out[0] if isinstance(out, tuple) else out


# Prefetch operands are not differentiated: a read has no tangent.
ad.defjvp_zero(prefetch_read_p)


def _pure(ref, *idx, tree):
  return prefetch_read_p.bind(ref, *idx, tree=tree)


def _get(ref, *idx, tree):
  return state_primitives.get_p.bind(ref, *idx, tree=tree)


def pure_reads(closed):
  """`closed` (a discharged per-point function whose only refs are the
  prefetch refs) with its ref reads pure."""
  return rewrite_closed(closed, {state_primitives.get_p: _pure})


def restore_reads(closed):
  """`closed` with `prefetch_read`s as the ref reads they stand for."""
  return rewrite_closed(closed, {prefetch_read_p: _get})
