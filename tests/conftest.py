"""Shared fixtures: free ports, subprocess servers on loopback, a private redis-server.

The real-vLLM tests run last. Their engines are session-scoped (a start costs a minute of
both cores), so they live until the run ends; run first, they shared the two cores with
every later test, and a clean-clone CI run on 2026-12-01 failed six timing-bound router
tests that way (41 minutes of pytest against 25 the run before).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REAL = Path(__file__).parent / "real"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: REAL in item.path.parents)
