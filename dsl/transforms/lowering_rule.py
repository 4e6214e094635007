"""pallas_call's MLIR lowering rule.

Under `jax.jit` over several devices (not inside `shard_map`) the kernel
partitions itself (dsl/transforms/partitioning.py); otherwise the backend the registry
resolves (`dsl.core.backends.resolve`: `backend=`, `interpret=`,
`jax_pallas_use_mosaic_gpu` and the platform being lowered for) gets the
kernel as it expects it (`Backend.prepare`), under the kernel's name. A
kernel with a dynamic grid dim is not partitioned (each device runs it
whole) and runs only on the backends that take traced grid sizes.
"""
from __future__ import annotations

import contextlib
import functools

from dsl.core.jax_internals import mlir, sharding_impls

from dsl.core import backends, dynamic_grid
from dsl.transforms import aliased_reads, partitioning
from dsl.core.errors import lowering_kernel
from dsl.core.pallas_call import KernelSpec, pallas_call_p


def _lower(ctx, *args, spec: KernelSpec, platform: str):
  ac = ctx.module_context.axis_context
  if (not spec.local and isinstance(ac, sharding_impls.ShardingContext)
      and ac.num_devices > 1 and not spec.grid_mapping.dynamic_dims):
    # jit over several devices: the kernel partitions itself. Inside
    # shard_map (an SPMDAxisContext) it is per device already.
    return partitioning.lower_partitioned(ctx, *args, spec=spec)
  name = backends.resolve(spec.backend, platform=platform)
  rule = backends.lowering_rule(name, spec.name, spec.where)
  dynamic_grid.check_backend(spec, backends.record(name))
  if backends.record(name).code == "mosaic":
    # A TPU never reads an output block from HBM: an aliased output read
    # before it is written starts from its input another way.
    derived = aliased_reads.reading_aliased_outputs(spec)
    if derived is not None:
      new, extra = derived
      n = len(spec.grid_mapping.dynamic_dims)
      bind = lambda *xs: pallas_call_p.bind(
          *xs, *[xs[n + i] for i in extra], spec=new)
      return mlir.lower_fun(bind, multiple_results=True)(ctx, *args)
  spec = backends.prepare(spec, name)
  with lowering_kernel(spec.name), _named(ctx, spec.name) as ctx:
    if spec.local:
      return partitioning.lower_local(rule, ctx, *args, spec=spec)
    return rule(ctx, *args, spec=spec)


@contextlib.contextmanager
def _named(ctx, kernel: str):
  """Puts the kernel's name on the name stack of everything lowered for it
  (XLA's op_name metadata, which profiler traces show)."""
  stack = ctx.name_stack.extend(kernel)
  loc = mlir.ir.Location.name(str(stack), childLoc=mlir.ir.Location.current)
  with loc:
    yield ctx.replace(name_stack=stack)


for _platform in ("cpu", "cuda", "rocm", "tpu"):
  mlir.register_lowering(pallas_call_p,
                         functools.partial(_lower, platform=_platform),
                         platform=_platform)
