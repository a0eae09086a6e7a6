"""nereus.monitor (see DESIGN.md)."""
