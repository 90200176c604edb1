"""The fleet: worker registry, health, load signals and DP-rank choice."""
