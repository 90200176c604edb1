"""Switchyard: a serving front for LLM inference fleets."""

__version__ = "0.2.0"
