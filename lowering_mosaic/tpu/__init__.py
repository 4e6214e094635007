"""The Mosaic TPU lowering: kernels as Mosaic-dialect MLIR."""
