"""What every package of the project may use: atomic file writes, the project's paths, the sweep summary."""
