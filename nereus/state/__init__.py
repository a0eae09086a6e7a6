"""nereus.state (see DESIGN.md)."""
