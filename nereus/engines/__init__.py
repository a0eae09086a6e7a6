"""nereus.engines (see DESIGN.md)."""
