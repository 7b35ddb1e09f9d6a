"""Charts and the markdown report of a cube."""
