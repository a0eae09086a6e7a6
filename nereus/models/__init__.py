"""nereus.models (see DESIGN.md)."""
