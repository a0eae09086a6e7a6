"""nereus.transfer (see DESIGN.md)."""
