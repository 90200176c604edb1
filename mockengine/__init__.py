"""mockengine."""
