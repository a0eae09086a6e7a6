"""nereus.planner (see DESIGN.md)."""
