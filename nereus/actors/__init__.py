"""nereus.actors (see DESIGN.md)."""
