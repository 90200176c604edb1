"""kvstore."""
