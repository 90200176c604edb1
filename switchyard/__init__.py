"""switchyard."""
