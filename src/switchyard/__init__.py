"""Switchyard: a serving front for LLM inference fleets."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``__version__`` from the installed metadata, read on first use so that importing the
    package stays free of work and every surface reports one number."""
    if name == "__version__":
        from switchyard.core.version import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
