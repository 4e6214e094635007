"""The status of Pallas's kernel library on dsl in the tests: which cases
fail today and why (strict xfails in test_pallas_ops.py, rows of
docs/pallas-compat.md) and which are too slow for the default suite. The
import swap itself and the ops' cases live in `benchmarks.pallas_library`
(the `pallas-ops` benchmark suite runs them too); its names are re-exported
here.
"""
from __future__ import annotations

from benchmarks.pallas_library.swap import (  # noqa: F401 -- re-exported
    GPU_BACKENDS, MGPU_BACKENDS, NO_PALLAS, OPS, ORIGINAL, PALLAS_IMPORTS,
    PREFIX, REWRITES, TPU_BACKENDS, backends_of, base_op, install, is_mgpu,
    ops_dir, original, rewrite, swapped)

# The section of docs/pallas-compat.md that lists the ops (written by
# pallas_ops_page.py).
SECTION = "## Pallas's kernel library on dsl"


# (op, backend) -> why it fails today: a strict xfail in test_pallas_ops.py
# (a fix shows up as an XPASS) and a row of docs/pallas-compat.md. Where
# Pallas's interpret mode fails on the same case too, PALLAS_FAILS_TOO says
# how (test_pallas_ops_limits.py holds both); the others are dsl's gaps,
# which Pallas's interpret mode runs (the same test holds that).
XFAIL: dict[tuple[str, str], str] = {
}

# `*_mgpu` op -> its module on backend "mosaic_gpu" (lowered for CUDA on
# the CPU), against Pallas's own lowering of the same source: the
# `Mosaic module` column of its `interpret` row (test_plgpu_lowering.py and
# test_plgpu_collectives.py compare them, test_plgpu_refusals.py holds the
# refusals; docs/mosaic-gpu.md says why each difference is no slower).
_SAME_AS_HOPPER = ("lowers on `mosaic_gpu`: the same schedule as Pallas's; "
                   "lowered, the same but for the grid and warpgroup "
                   "indices, read once (one warp shuffle fewer)")
_ATTENTION = ("lowers on `mosaic_gpu`: the same schedule as Pallas's; "
              "lowered, the same but for the indices, read once, and dead "
              "values the library erases later")
_MULTIMEM = ("lowers on `mosaic_gpu` inside `shard_map` over the devices: "
             "the same {}, multicast signal and wait as Pallas's; lowered, "
             "the same but for the tile's unit dim, which dsl's vectors "
             "drop (fewer index ops)")
_BLACKWELL_REFUSED = ("refused by name on `mosaic_gpu` (TMEM and the tcgen05 "
                      "MMA are Blackwell's); Pallas lowers it")
MGPU_MODULES: dict[str, str] = {
    "gpu.hopper_matmul_mgpu": _SAME_AS_HOPPER,
    "gpu.hopper_mixed_type_matmul_mgpu": _SAME_AS_HOPPER,
    "gpu.attention_mgpu": _ATTENTION,
    "gpu.attention_mgpu (causal)": _ATTENTION,
    "gpu.ragged_dot_mgpu": "lowers on `mosaic_gpu`: lowered, Pallas's module",
    "gpu.transposed_ragged_dot_mgpu": ("lowers on `mosaic_gpu`: lowered, "
                                       "Pallas's module"),
    "gpu.all_gather_mgpu": _MULTIMEM.format("multicast stores"),
    "gpu.reduce_scatter_mgpu": _MULTIMEM.format("reducing multicast loads"),
    "gpu.collective_matmul_mgpu": (
        "lowers on `mosaic_gpu` inside `shard_map` over the devices: the "
        "same schedule, TMA stores to the peer, signals and waits as "
        "Pallas's; lowered, the same but for the warpgroup index, read once "
        "(4 warp shuffles fewer)"),
    "gpu.blackwell_matmul_mgpu": _BLACKWELL_REFUSED,
    "gpu.blackwell_ragged_dot_mgpu": _BLACKWELL_REFUSED,
}


# Op -> a pattern of the error Pallas's interpret mode (unswapped, in the
# case's context) raises on the op's case: the XFAILs that are limits Pallas
# shares, and the ops compared with their reference only because Pallas
# cannot run them (NO_PALLAS). test_pallas_ops_limits.py asserts each, so a
# Pallas release that runs one shows up.
PALLAS_FAILS_TOO: dict[str, str] = {
    "gpu.collective_matmul_mgpu": "Cannot lower jaxpr with effects",
    "gpu.reduce_scatter_mgpu": "nan \\+ semaphore",
    "gpu.all_gather_mgpu": "nan \\+ semaphore",
    "gpu.blackwell_ragged_dot_mgpu": "collective_axis not supported yet",
    "tpu.ragged_paged_attention": (
        "'ReshapeTransform' object has no attribute 'indices'"),
    "gpu.hopper_mixed_type_matmul_mgpu": "Expected shape \\(6,\\) but got",
    "gpu.attention_mgpu": "Cannot lower jaxpr with effects",
    "gpu.attention_mgpu (causal)": "Cannot lower jaxpr with effects",
}


# Cases too slow for the default suite (pytest -m slow runs them).
_TOO_SLOW = {
    ("gpu.layer_norm (grad)", "interpret"),
    ("gpu.rms_norm (grad)", "interpret"),
    # 132 blocks (the op fixes the SM count of an H100)
    ("gpu.ragged_dot_mgpu", "interpret"),
    ("gpu.attention_mgpu (causal)", "interpret"),
    ("gpu.hopper_mixed_type_matmul_mgpu", "interpret"),
}
# The backend the default suite checks an op on, first that is not too slow
# and, for a TPU op, passes: the other backends run under -m slow.
_PREFERRED = {"tpu": ("mosaic_interpret", "interpret"),
              "gpu": ("interpret", "triton_interpret")}


def default_backend(op: str) -> str | None:
  """The one backend the default suite runs op `op` on (None: every case of
  it is too slow)."""
  backends = backends_of(op)
  ranked = [b for b in _PREFERRED[op.split(".")[0]] if b in backends]
  fine = [b for b in ranked if (op, b) not in _TOO_SLOW]
  passing = [b for b in fine if (op, b) not in XFAIL]
  return (passing or fine or [None])[0]


SLOW: set[tuple[str, str]] = _TOO_SLOW | {
    (op, b) for op in OPS for b in backends_of(op)
    if b != default_backend(op)}


# The golden comparison of the TPU cases (test_pallas_ops_golden.py: dsl's
# Mosaic modules against Pallas's own lowering). A case -> why its modules
# are not Pallas's: a strict xfail there, and a note on the page.
GOLDEN_DIFFERS: dict[str, str] = {}
# The variants that lower (dsl and Pallas together) in 0.5 s or more
# (`pytest --durations=0` on a shared 2-core machine): under -m slow. The
# other variants lower in well under a second and run by default, beside
# every op's cheap case.
GOLDEN_SLOW: set[str] = {
    "tpu.flash_attention [non-causal, bias, sm_scale, 2 k blocks]",
    "tpu.flash_attention [bfloat16]",
    "tpu.flash_attention [grad, causal]",
    "tpu.flash_attention [grad, segment ids, bias, 2 k blocks]",
    "tpu.all_gather [8 devices]",
    "tpu.paged_attention [soft cap]",
    "tpu.paged_attention [quantized KV cache]",
    "tpu.paged_attention [megacore kv_head]",
    "tpu.paged_attention [megacore batch]",
    "tpu.paged_attention [grid over the sequence]",
    "tpu.splash_attention [bfloat16]",
    "tpu.splash_attention [grad, causal]",
    "tpu.splash_attention [grad, local mask, segment ids, soft cap]",
    "tpu.splash_attention [grad, fused backward kernel]",
    "tpu.ragged_paged_attention [sliding window]",
    "tpu.ragged_paged_attention [soft cap, sm_scale]",
    "tpu.ragged_paged_attention [k_scale, v_scale, mask_value]",
    "tpu.random.threefry [3-D, 2 x 16 x 256]",
    "tpu.random.threefry [padded, 20 x 1000]",
    "tpu.random.philox [3-D, 2 x 16 x 256]",
    "tpu.megablox.gmm [bfloat16]",
    "tpu.megablox.gmm [transpose_rhs, k of 192 (a partial k tile)]",
    "tpu.megablox.gmm [group offset: groups 1-2 of 3]",
    "tpu.megablox.gmm [group offset, existing_out]",
    "tpu.megablox.tgmm [bfloat16]",
    "tpu.megablox.tgmm [group offset, num_actual_groups: groups 1-2 of 3]",
    "tpu.megablox.gmm (grad) [transpose_rhs]",
    "tpu.megablox.gmm (grad) [group offset: groups 1-2 of 3]",
}


if __name__ == "__main__":
  # The page's table needs the cases, which need this module: the page
  # module writes it (`python -m tests.pallas.pallas_ops_page` does too).
  from tests.pallas import pallas_ops_page
  pallas_ops_page.write_compat_section()
