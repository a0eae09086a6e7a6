"""nereus.rl (see DESIGN.md)."""
