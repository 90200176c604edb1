"""The installed package's version, read from its metadata so that ``--version``, the
router's start-up line and its ``/health`` report the number the wheel was built with."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

DISTRIBUTION = "switchyard"


@functools.cache
def version() -> str:
    """The installed version; ``unknown`` for a source tree that was never installed, since
    a made-up number would look like a release."""
    try:
        return _metadata_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
