"""Pallas's Mosaic GPU programming model ("plgpu") on dsl.

    from dsl import mosaic_gpu as plgpu

The names of Pallas's Mosaic GPU module (`pallas.mosaic_gpu`) that Hopper
kernels use:
`plgpu.kernel` over blocks and warpgroups, SMEM scratch with tiling and
swizzle transforms, TMA copies (`copy_gmem_to_smem`, `copy_smem_to_gmem`,
`commit_smem`, `wait_smem_to_gmem`), mbarriers (`Barrier`, `barrier_arrive`,
`barrier_wait`), WGMMA into accumulators (`ACC`, `wgmma`, `wgmma_wait`),
register layouts (`Layout`, `layout_cast`), pipelines
(`emit_pipeline`, `emit_pipeline_warp_specialized`), loops over work items
(`nd_loop`, `planar_snake`), Blackwell's tensor core (`TMEM`,
`tcgen05_mma`, `tcgen05_commit_arrive`, `async_load_tmem`,
`wait_load_tmem`, `async_store_tmem`, `commit_tmem`,
`async_copy_smem_to_tmem`), warps and work claiming (`warp_map`,
`dynamic_scheduling_loop`, `try_cluster_cancel`, `query_cluster_cancel`,
`TryClusterCancelResult`), the multi-device names (`remote_ref`,
`multimem_store`, `multimem_load_reduce`, `semaphore_signal_multicast`)
and `CompilerParams` (also the Mosaic GPU backend's schedule overrides). docs/mosaic-gpu.md, "Pallas's Mosaic GPU
API (plgpu)", says what each does here and what differs from Pallas.

The interpret backend runs `plgpu.kernel`s on any platform
(dsl/interpret/warpgroups.py); backend "mosaic_gpu" lowers those whose
primitives it has rules for (lowering_mosaic/gpu/mesh_kernel.py).
"""
from dsl.core.semaphores import SemaphoreType
from dsl.mosaic_gpu.multi_device import (PeerMemRef, multimem_load_reduce,
                                         multimem_store, remote_ref,
                                         semaphore_signal_multicast)
from dsl.mosaic_gpu.compiler_params import (CompilerParams, LoweringSemantics,
                                            TraceScope)
from dsl.mosaic_gpu.compute import (broadcasted_iota, layout_cast, load,
                                    set_max_registers, store, wgmma,
                                    wgmma_accumulator_load, wgmma_wait)
from dsl.mosaic_gpu.helpers import (NDLoopInfo, find_swizzle, nd_loop,
                                    planar_snake)
from dsl.mosaic_gpu.kernel import (Mesh, force_gpu_interpret_mode, kernel,
                                   set_gpu_interpret_mode)
from dsl.mosaic_gpu.memory import (ACC, GMEM, REGS, SMEM, TMEM, Barrier,
                                   BlockSpec, ClusterBarrier, CopyPartition,
                                   GPUMemoryRef,
                                   Layout, MemorySpace, OOBFillMode,
                                   SwizzleTransform, TilingTransform,
                                   WGMMAAccumulatorRef)
from dsl.mosaic_gpu.pipeline import (emit_pipeline,
                                     emit_pipeline_warp_specialized)
from dsl.mosaic_gpu.scheduling import (TryClusterCancelResult,
                                       dynamic_scheduling_loop,
                                       query_cluster_cancel,
                                       try_cluster_cancel, warp_map)
from dsl.mosaic_gpu.tensor_memory import (async_copy_smem_to_tmem,
                                          async_load_tmem, async_store_tmem,
                                          commit_tmem, tcgen05_commit_arrive,
                                          tcgen05_mma, wait_load_tmem)
from dsl.mosaic_gpu.primitives import (barrier_arrive,
                                       barrier_arrive_and_wait, barrier_wait,
                                       commit_smem, commit_smem_to_gmem_group,
                                       copy_gmem_to_smem, copy_smem_to_gmem,
                                       wait_smem_to_gmem)

__all__ = [
    "ACC", "Barrier", "BlockSpec", "ClusterBarrier", "CompilerParams", "GMEM",
    "GPUMemoryRef", "Layout", "LoweringSemantics", "MemorySpace", "Mesh",
    "NDLoopInfo", "REGS", "SMEM", "SemaphoreType", "SwizzleTransform", "TMEM",
    "TilingTransform", "WGMMAAccumulatorRef", "barrier_arrive", "barrier_wait",
    "broadcasted_iota", "commit_smem", "commit_smem_to_gmem_group",
    "copy_gmem_to_smem", "copy_smem_to_gmem", "emit_pipeline",
    "emit_pipeline_warp_specialized", "find_swizzle", "kernel", "layout_cast",
    "load", "nd_loop", "planar_snake", "set_max_registers",
    "wait_smem_to_gmem", "wgmma", "wgmma_wait", "PeerMemRef",
    "multimem_load_reduce", "multimem_store", "remote_ref",
    "semaphore_signal_multicast", "OOBFillMode", "TraceScope",
    "barrier_arrive_and_wait", "force_gpu_interpret_mode",
    "set_gpu_interpret_mode", "store", "wgmma_accumulator_load",
    "TryClusterCancelResult", "async_copy_smem_to_tmem", "async_load_tmem",
    "async_store_tmem", "commit_tmem", "dynamic_scheduling_loop",
    "query_cluster_cancel", "tcgen05_commit_arrive", "tcgen05_mma",
    "try_cluster_cancel", "wait_load_tmem", "warp_map", "CopyPartition",
]
