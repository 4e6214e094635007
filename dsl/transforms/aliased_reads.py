"""Aliased outputs that a kernel reads before writing, on the Mosaic backends.

With `input_output_aliases`, an output starts as its input, and a kernel may
read the output's block before writing it (`o_ref[...] = o_ref[...] * 2 +
1`). The interpret and Triton backends read the block from the output's
memory, which holds the input. A TPU's grid pipeline never reads an output
block from HBM: the block's VMEM buffer holds stale data when the block
starts. So for the Mosaic backends (`mosaic`, `mosaic_interpret`) such a
kernel is rewritten: it also takes the aliased input once more, blocked as
the output, and copies that block into the output block at the first step
of each run of visits to it (`first_visit`), before the kernel's body. A TPU
then computes what every other backend computes. A kernel that writes its
aliased outputs before reading them is left as it is, and so is one that
provably writes the output block whole at each first visit before using it
(megablox's `gmm` with `existing_out`: dsl/transforms/first_visit_writes.py),
since the copy would only write what the kernel overwrites.
"""
from __future__ import annotations

import dataclasses
import functools

from dsl.core.jax_internals import core

from dsl.core.grid_plan import first_read_before_write
from dsl.core.memory import MemorySpace
from dsl.core.pallas_call import KernelSpec
from dsl.core.primitives import when
from dsl.core.tracing import num_programs, program_id
from dsl.transforms.common import block_spec_of, derived_spec, sds
from dsl.transforms.first_visit_writes import written_at_first_visits
from dsl.transforms.revisits import first_visit


_IN_HBM = (MemorySpace.ANY, MemorySpace.HBM)


def _read_first(spec: KernelSpec) -> list[tuple[int, int]]:
  """(operand index, output index) of the aliased outputs with a block
  (not `ANY` memory) that the kernel may read before writing, unless it
  provably writes the block whole at each first visit before using it."""
  gm = spec.grid_mapping
  outs = gm.split(spec.jaxpr.jaxpr.invars).outputs
  found = []
  for operand, o in spec.input_output_aliases:
    in_hbm = gm.out_mappings[o].memory_space in _IN_HBM
    if gm.aliased_operand(operand)[0] == "prefetch" or in_hbm:
      continue              # the kernel addresses the aliased memory itself
    if (first_read_before_write(spec.jaxpr, [outs[o]]) is not None
        and not written_at_first_visits(spec, o)):
      found.append((operand, o))
  return found


@functools.lru_cache(maxsize=256)
def reading_aliased_outputs(spec: KernelSpec):
  """`(spec', operands)`: the kernel that starts each block of an aliased
  output it reads before writing from the aliased input, and the operand
  indices to pass once more after the kernel's own operands; None when
  the kernel needs no such rewrite. The operand indices count the
  scalar-prefetch operands and inputs, not the grid sizes before them."""
  if spec.meta and spec.meta[0] == "aliased_reads":
    return None
  pairs = _read_first(spec)
  if not pairs:
    return None
  gm = spec.grid_mapping
  n_grid = len(gm.grid)
  layout = gm.ref_layout().insert("inputs", starts=len(pairs))

  def body(*refs):
    ids = [program_id(d) for d in range(n_grid)]
    grid = [num_programs(d) for d in range(n_grid)]   # traced where dynamic
    _, pf, ins, starts, outs, scr = layout.split(refs)
    for (_, o), start in zip(pairs, starts):
      @when(first_visit(gm.out_mappings[o], grid, ids, lambda i: i, pf))
      def _(o=o, start=start):
        outs[o][...] = start[...]
    core.eval_jaxpr(spec.jaxpr.jaxpr, spec.jaxpr.consts, *ids, *pf, *ins,
                    *outs, *scr)

  operand_avals = [a.inner_aval for a in gm.prefetch_avals] + [
      bm.array_aval for bm in gm.in_mappings]
  args = [sds(a) for a in operand_avals] + [
      sds(operand_avals[i]) for i, _ in pairs]
  spec_of = lambda bm: block_spec_of(bm, n_grid)
  new = derived_spec(
      spec, body, args, [sds(bm.array_aval) for bm in gm.out_mappings],
      grid=gm.grid,
      in_specs=([spec_of(bm) for bm in gm.in_mappings]
                + [spec_of(gm.out_mappings[o]) for _, o in pairs]),
      out_specs=[spec_of(bm) for bm in gm.out_mappings],
      scratch=list(gm.scratch_avals), aliases=dict(spec.input_output_aliases),
      suffix="", meta=("aliased_reads", spec))
  labels = gm.split(spec.ref_labels())
  names = (list(labels.prefetch + labels.inputs)
           + [f"{labels.outputs[o]} (its aliased input)" for _, o in pairs]
           + list(labels.outputs + labels.scratch))
  # The user's cost estimate stays (the copy is one more block read).
  new = new.replace(local=spec.local, ref_names=tuple(names),
                    cost_estimate=spec.cost_estimate,
                    grid_mapping=dataclasses.replace(
                        new.grid_mapping, num_hidden_axes=gm.num_hidden_axes))
  return new, tuple(i for i, _ in pairs)
