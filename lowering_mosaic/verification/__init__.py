"""Verification of Mosaic modules: the MLIR interpreter and the Promela
exporter."""
