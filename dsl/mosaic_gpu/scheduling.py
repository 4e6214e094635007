"""Who runs what inside a `plgpu.kernel`: the warps of a warpgroup
(`warp_map`) and the blocks that claim work (`dynamic_scheduling_loop`,
built on cluster launch control: `try_cluster_cancel`,
`query_cluster_cancel`).

- `warp_map(f)` runs `f(warp_id)` on each of the 4 warps of the calling
  warpgroup, at the same time (each warp waits at mbarriers on its own, so
  one warp can feed the tensor core while another issues its MMAs); the
  warpgroup goes on when every warp has returned.
- `try_cluster_cancel(result, barrier)` asks the hardware for the grid
  index of a block that has not started (cancelling its launch); the
  answer lands in `result` (SMEM) and arrives on `barrier`.
  `query_cluster_cancel(result, grid_names)` decodes it: (grid indices,
  whether a block was claimed).
- `dynamic_scheduling_loop(grid_names)(body)` runs `body(NDLoopInfo)` for
  the block's own grid index, then for each block it claims, until a claim
  fails.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from dsl.core import named_axes
from dsl.core.errors import KernelError, user_frame
from dsl.core.jax_internals import (api_util, core, linear_util as lu,
                                    partial_eval as pe)
from dsl.core.operand_layout import pack, ref_and_transforms as ref_parts
from dsl.core.primitives import loop, run_scoped, scoped_effects, when
from dsl.mosaic_gpu.helpers import NDLoopInfo
from dsl.mosaic_gpu.memory import SMEM, Barrier, space_of
from dsl.mosaic_gpu.primitives import (barrier_arrive, barrier_parts,
                                       barrier_wait, gpu_effect, ref_effects)

WARPS_PER_WARPGROUP = 4

# ------------------------------------------------------------------- warps

warp_map_p = Primitive("warp_map")
warp_map_p.multiple_results = True


@warp_map_p.def_effectful_abstract_eval
def _warp_map_abstract_eval(*avals, jaxpr, num_consts):
  return [], scoped_effects(jaxpr, num_consts) | {gpu_effect}


def warp_map(f: Callable[[Any], None], /) -> None:
  """Runs `f(warp_id)` on each warp of this warpgroup at once; returns when
  every warp has (`f` returns nothing)."""
  warp_id = core.ShapedArray((), jnp.int32)
  dbg = api_util.debug_info("warp_map", f, (0,), {})
  jaxpr, outs, consts = pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(lambda w: (f(w), [])[1], debug_info=dbg), [warp_id])
  del outs
  jaxpr = pe.convert_constvars_jaxpr(jaxpr)
  warp_map_p.bind(*consts, jaxpr=jaxpr, num_consts=len(consts))


# (`lax.axis_index` of a grid axis inside the body: the kernel's rewrite
# binds the warp map again around the rewritten body)
named_axes.register_body_primitive(warp_map_p,
                                   lambda f, eqn: warp_map(f) or [])


# ------------------------------------------------------ cluster launch control

def TryClusterCancelResult(num_buffers: int | None = None):  # noqa: N802
  """A scratch type for `try_cluster_cancel`'s 16-byte answers: one, or
  `num_buffers` of them."""
  shape = (16,) if num_buffers is None else (int(num_buffers), 16)
  return SMEM(shape, jnp.int8)


try_cluster_cancel_p = Primitive("try_cluster_cancel")
try_cluster_cancel_p.multiple_results = True


@try_cluster_cancel_p.def_effectful_abstract_eval
def _try_cancel_abstract_eval(*avals, layout, collective_axes):
  return [], ref_effects(layout, writes=("result", "barrier"))


def _result_ref(result_ref):
  ref, transforms = ref_parts("result_ref", result_ref)
  if space_of(core.typeof(ref)) is not SMEM:
    raise KernelError(None, "result_ref must be a ref in SMEM (a "
                      "plgpu.TryClusterCancelResult)", user_frame(),
                      operand="result_ref")
  return ref, transforms


def try_cluster_cancel(result_ref, barrier, *,
                       collective_axes: Hashable | tuple = ()) -> None:
  """Asks for the grid index of a block not started yet; the answer lands
  in `result_ref` and arrives on `barrier`."""
  if not isinstance(collective_axes, tuple):
    collective_axes = (collective_axes,)
  ref, transforms = _result_ref(result_ref)
  bar, bar_t = barrier_parts("barrier", barrier)
  flat, layout = pack(result=ref, result_t=transforms, barrier=bar,
                      barrier_t=bar_t)
  try_cluster_cancel_p.bind(*flat, layout=layout,
                            collective_axes=collective_axes)


query_cluster_cancel_p = Primitive("query_cluster_cancel")
query_cluster_cancel_p.multiple_results = True


@query_cluster_cancel_p.def_effectful_abstract_eval
def _query_cancel_abstract_eval(*avals, layout, grid_names):
  outs = [core.ShapedArray((), jnp.int32)] * len(grid_names)
  return [*outs, core.ShapedArray((), jnp.bool_)], ref_effects(
      layout, reads=("result",))


def query_cluster_cancel(result_ref, grid_names: Sequence[Hashable]):
  """`(grid indices, claimed)` of a `try_cluster_cancel` answer (the
  indices mean nothing when `claimed` is False)."""
  ref, transforms = _result_ref(result_ref)
  flat, layout = pack(result=ref, result_t=transforms)
  *index, claimed = query_cluster_cancel_p.bind(
      *flat, layout=layout, grid_names=tuple(grid_names))
  return tuple(index), claimed


_SLOTS = 2


def dynamic_scheduling_loop(grid_names, thread_axis=None, cluster_axes=(),
                            init_carry=None):
  """Decorator: runs `body(NDLoopInfo)` (or `body(info, carry=c)` -> new
  carry, with `init_carry`) for this block's grid index, then for every
  block it claims with `try_cluster_cancel`, until a claim fails.
  `local_index` counts the steps of this block; `thread_axis` names the
  warpgroup axis when the kernel has several, `cluster_axes` every cluster
  axis."""
  if cluster_axes:
    raise KernelError(None, "dynamic_scheduling_loop over clusters "
                      "(cluster_axes) is not supported yet", user_frame(),
                      operand="cluster_axes")
  threads = 1 if thread_axis is None else lax.axis_size(thread_axis)
  collective = () if thread_axis is None else (thread_axis,)

  def decorate(body):
    def scoped(results, claimed_barrier, used_barrier):
      def step(carry):
        index, _, local, user = carry
        slot = lax.rem(local, jnp.int32(_SLOTS))

        @when(local >= _SLOTS)
        def _():
          barrier_wait(used_barrier.at[slot])
        try_cluster_cancel(results.at[slot], claimed_barrier.at[slot],
                           collective_axes=collective)
        info = NDLoopInfo(index, local, None)
        user = body(info) if init_carry is None else body(info, carry=user)
        barrier_wait(claimed_barrier.at[slot])
        index, claimed = query_cluster_cancel(results.at[slot], grid_names)
        barrier_arrive(used_barrier.at[slot])
        return index, claimed, local + 1, user

      start = (tuple(map(lax.axis_index, grid_names)), jnp.bool_(True),
               jnp.int32(0), init_carry)
      *_, steps, user = lax.while_loop(lambda c: c[1], step, start)

      @loop(jnp.int32(0), lax.min(steps, jnp.int32(_SLOTS)))
      def _(slot):
        barrier_wait(used_barrier.at[slot])
      return user

    return run_scoped(
        scoped, TryClusterCancelResult(_SLOTS),
        Barrier(num_arrivals=threads, num_barriers=_SLOTS),
        Barrier(num_arrivals=threads, num_barriers=_SLOTS),
        collective_axes=collective)
  return decorate
