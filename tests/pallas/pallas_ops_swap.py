"""The status of Pallas's kernel library on dsl in the tests: which cases
fail today and why (strict xfails in test_pallas_ops.py, rows of
docs/pallas-compat.md) and which are too slow for the default suite. The
import swap itself and the ops' cases live in `benchmarks.pallas_library`
(the `pallas-ops` benchmark suite runs them too); its names are re-exported
here.
"""
from __future__ import annotations

from benchmarks.pallas_library.swap import (  # noqa: F401 -- re-exported
    GPU_BACKENDS, NO_PALLAS, OPS, ORIGINAL, PREFIX, REWRITES, TPU_BACKENDS,
    backends_of, base_op, install, ops_dir, original, rewrite, swapped)


# (op, backend) -> why it fails today: a strict xfail in test_pallas_ops.py
# (a fix shows up as an XPASS) and a row of docs/pallas-compat.md.
XFAIL: dict[tuple[str, str], str] = {
    ("tpu.megablox.gmm", "interpret"):
        "traced grid sizes: the number of active tiles is computed from the "
        "group sizes (grid[1] must be a positive integer, got a tracer)",
    ("tpu.megablox.gmm", "mosaic_interpret"):
        "traced grid sizes: the number of active tiles is computed from the "
        "group sizes (grid[1] must be a positive integer, got a tracer)",
    ("tpu.megablox.tgmm", "interpret"):
        "traced grid sizes: the number of active tiles is computed from the "
        "group sizes (grid[2] must be a positive integer, got a tracer)",
    ("tpu.megablox.tgmm", "mosaic_interpret"):
        "traced grid sizes: the number of active tiles is computed from the "
        "group sizes (grid[2] must be a positive integer, got a tracer)",
}

# The matrix's megacore variants on mosaic_interpret (test_pallas_ops.py).
_ONE_CORE = (
    "mosaic_interpret runs the two megacore \"cores\" (grid dim 0, "
    "\"parallel\") one after the other on one TensorCore with one SMEM, as "
    "a chip without megacore does: the second core finds the first's "
    "\"initialized\" flag cleared and waits for a DMA it never started (a "
    "deadlock the op's docstring warns of without megacore; `interpret` "
    "gives each core its own SMEM)")
XFAIL.update({(v, "mosaic_interpret"): _ONE_CORE for v in (
    "tpu.paged_attention [megacore kv_head]",
    "tpu.paged_attention [megacore batch]",
    "tpu.paged_attention (grad) [megacore batch]")})

# The matrix's GPU gradients that the Triton backend cannot lower.
XFAIL.update({
    ("gpu.layer_norm [grad]", "triton_interpret"):
        "the op's backward kernels index a ref with two arrays of indices "
        "broadcast together (`x_ref.at[rows[:, None], cols[None]]`); the "
        "Triton backend takes one vector of indices per ref access",
    ("gpu.rms_norm [grad]", "triton_interpret"):
        "the op's backward kernels index a ref with two arrays of indices "
        "broadcast together (`x_ref.at[rows[:, None], cols[None]]`); the "
        "Triton backend takes one vector of indices per ref access",
    ("gpu.paged_attention [grad]", "triton_interpret"):
        "the transposed kernel gathers from the K/V pages with a form of "
        "lax.gather (array indexing) the Triton backend does not lower",
    ("gpu.softmax [grad]", "triton_interpret"):
        "the transposed kernel scatters (the transpose of the masked row "
        "read), which the Triton backend does not lower",
})

# Cases too slow for the default suite (pytest -m slow runs them).
SLOW: set[tuple[str, str]] = set()


if __name__ == "__main__":
  # The page's table needs the cases, which need this module: the page
  # module writes it (`python -m tests.pallas.pallas_ops_page` does too).
  from tests.pallas import pallas_ops_page
  pallas_ops_page.write_compat_section()
