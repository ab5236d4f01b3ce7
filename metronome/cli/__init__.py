"""Command-line entry points (they sit on top of the core, sim and probe layers)."""
