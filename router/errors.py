"""Errors the router answers itself, always in the OpenAI error shape."""

from __future__ import annotations

from switchyard.errors import APIError


class RouterError(APIError):
    """Raised anywhere on the data path; turned into one JSON error response."""
