"""Shared fixtures: free ports, subprocess servers on loopback, a private redis-server.

The real-vLLM tests run last. Their engines are session-scoped (a start costs a minute or
more of CPU), so they live until the run ends; run first, they would share the cores with
every later test and make timing-bound router tests fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REAL = Path(__file__).parent / "real"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: REAL in item.path.parents)
