"""lowering_mosaic: see DESIGN.md."""
