"""lowering_triton: see DESIGN.md."""
