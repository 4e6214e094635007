"""kernels: see DESIGN.md."""
