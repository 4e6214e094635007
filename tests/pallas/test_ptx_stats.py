"""lowering_triton.ptx_stats on small PTX snippets: instructions and their
classes, loops and the innermost (hot) ones, predicated loads, and the
occupancy arithmetic; and on a kernel compiled ahead of time."""
import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from lowering_triton import aot, ptx_stats as ps

NESTED = """
.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .pred 	%p<4>;
	ld.param.u64 	%rd1, [k_param_0];   // a parameter, not global memory
$L__BB0_1:                              // outer loop
	mov.b32 	%r1, 0;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=2
	@%p1 ld.global.v4.b32 	{%r2, %r3, %r4, %r5}, [%rd1];
	ld.global.nc.b32 	%r6, [%rd1+16];
	selp.b32 	%r7, %r2, 0, %p2;
	cp.async.cg.shared.global [ %r8 + 0 ], [ %rd1 + 0 ], 0x10, %r9;
	cp.async.commit_group;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r10}, %rd2, %rd3, %p1, 1, 1, 0, 1;
	bar.sync 	0;
	@!%p3 bra 	$L__BB0_2;
// %bb.3:
	st.shared.v4.b32 	[%r8], {%r2, %r3, %r4, %r5};
	@%p2 st.global.b32 	[%rd1], %r7;
	@%p1 bra 	$L__BB0_1;
	st.local.b32 	[%rd4], %r1;
	bra.uni 	$L__BB0_5;
$L__BB0_5:
	ret;
}
"""


def test_instructions_skip_directives_labels_and_comments():
  insts = ps.instructions(NESTED)
  ops = [op for _, op, _, _ in insts]
  assert ops[0] == "ld.param.u64" and ops[-1] == "ret"
  assert ".reg" not in " ".join(ops) and "$L__BB0_1:" not in ops
  predicated = [op for _, op, _, pred in insts if pred]
  assert predicated == ["ld.global.v4.b32", "bra", "st.global.b32", "bra"]


def test_loops_are_back_edges_and_the_hot_ones_the_innermost():
  loops = ps.loops(NESTED)
  assert [lp.label for lp in loops] == ["$L__BB0_1", "$L__BB0_2"]
  outer, inner = loops
  assert outer.first < inner.first and inner.last < outer.last
  assert [lp.label for lp in ps.innermost(loops)] == ["$L__BB0_2"]
  # a forward branch ($L__BB0_5) is no loop


def test_the_mix_of_the_hot_loop_counts_per_iteration():
  stats = ps.ptx_stats(NESTED)
  (hot,) = stats.hot_loops
  assert hot.mix == ps.Mix(instructions=8, selp=1, ld_global=2,
                           ld_global_predicated=1, cp_async=1, wgmma=1, bar=1)
  k = stats.kernel
  assert (k.st_shared, k.st_global, k.st_local, k.ld_global) == (1, 1, 1, 2)
  assert k.stores == 3
  assert stats.spills          # the st.local
  assert not ps.ptx_stats(NESTED.replace("st.local", "st.shared")).spills


def test_a_kernel_without_loops_has_no_hot_loop():
  stats = ps.ptx_stats("{\n\tld.global.b32 %r1, [%rd1];\n\tret;\n}\n")
  assert stats.loops == () and stats.hot_loops == ()
  assert stats.kernel.instructions == 2


@pytest.mark.parametrize("regs,warps,shared,want", [
    (164, 4, 98304, 2),      # the bf16 matmul: shared memory binds
    (255, 8, 0, 1),          # registers bind: 256 x 32 x 8 = 64 Ki
    (32, 4, 16, 16),         # warp slots bind
    (24, 1, 0, 32),          # the block limit
    (None, 4, 300000, 0),    # more shared memory than an SM has
])
def test_programs_per_sm(regs, warps, shared, want):
  assert ps.blocks_per_sm(regs, warps, shared) == want


def test_an_aot_kernel_reports_its_stats():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=(4,), in_specs=[pl.BlockSpec((256,),
                                                                 lambda i: (i,))],
                               out_specs=pl.BlockSpec((256,), lambda i: (i,)),
                               backend="triton")(x)
  (k,) = aot.compile_aot(f, jax.ShapeDtypeStruct((1024,), jnp.float32))
  stats = k.stats()
  assert stats.kernel.ld_global >= 1 and stats.kernel.st_global >= 1
  assert stats.kernel.ld_global_predicated == 0     # whole blocks: no mask
  assert stats.hot_loops == ()
  if ps.cuobjdump() is not None:
    assert 0 < stats.registers <= 255 and stats.local_bytes == 0
