"""The launch parameters of a generated kernel: num_warps and num_stages.

A kernel's compiler params give them; where they give none, Pallas's
defaults apply (4 warps, 3 stages), so a kernel ported from Pallas launches
as it did there.

A kernel of reverse mode (`KernelSpec.launch_inherited`: a recording or
transposed kernel) carries the compiler params of the kernel it was derived
from, tuned for that kernel's work. Where it has no dot, its warps come
from its blocks instead: a row kernel loads its input blocks whole and
keeps them live while it reduces over them, so each thread holds its share
of every input block in registers, besides the temporaries computed from
them. The warps are the fewest (at least the inherited or default count,
at most MAX_WARPS) that keep that share within INPUT_WORDS_PER_THREAD
32-bit registers: more threads split the blocks thinner, where fewer would
need more than the 255 registers a thread has and spill (e.g. two float32
(16, 1024) blocks over 4 warps: 256 words a thread). A kernel with a dot
keeps the inherited warps: its dot's tiles are the forward kernel's, and
so is the warp layout tuned for them.
"""
from __future__ import annotations

import math

from jax import lax
from dsl.core.jaxpr_walk import sub_jaxprs

DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
MAX_WARPS = 16
# A quarter of a thread's 255 registers for the input blocks leaves room
# for the temporaries of a backward row kernel (about as many again) and
# its addresses; measured on sm_90 with the derived softmax, layer norm and
# RMS norm backward kernels (docs/transformations.md).
INPUT_WORDS_PER_THREAD = 64
WARP = 32


def launch_config(spec) -> tuple[int, int]:
  """(num_warps, num_stages) of the kernel of `spec`."""
  cp = spec.compiler_params
  warps = getattr(cp, "num_warps", None) or DEFAULT_NUM_WARPS
  stages = getattr(cp, "num_stages", None) or DEFAULT_NUM_STAGES
  if spec.launch_inherited and not _has_dot(spec.jaxpr.jaxpr):
    warps = max(warps, block_warps(spec))
  return warps, stages


def block_warps(spec) -> int:
  """The fewest warps (a power of two, at most MAX_WARPS) that give each
  thread at most INPUT_WORDS_PER_THREAD words of the input blocks."""
  gm = spec.grid_mapping
  words = sum(math.prod(bm.block_sizes) * max(1, bm.array_aval.dtype.itemsize // 4)
              for bm in gm.in_mappings)
  need = -(-words // (WARP * INPUT_WORDS_PER_THREAD))
  warps = 1
  while warps < min(need, MAX_WARPS):
    warps *= 2
  return warps


def _has_dot(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is lax.dot_general_p:
      return True
    if any(_has_dot(sub) for sub in sub_jaxprs(eqn.params)):
      return True
  return False
