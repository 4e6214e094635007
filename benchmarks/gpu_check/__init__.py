"""The one GPU check (`make gpu-check`, `python -m benchmarks.gpu_check`):
GPU-marked tests, the Triton and Mosaic GPU benchmarks beside cuBLAS, cuDNN,
XLA and Pallas, the quick suite, one record per run in benchmarks/results/,
rows slower than the last record flagged, and the shipped GPU defaults
refreshed from the run's winners. See docs/benchmarks.md."""
from benchmarks.gpu_check.cli import main

__all__ = ["main"]
