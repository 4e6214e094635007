"""benchmarks: see DESIGN.md."""
