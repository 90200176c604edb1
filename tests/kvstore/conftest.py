"""Index fixtures: the same behaviour suite runs on memory and on a real redis-server."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import pytest

from switchyard.kvstore.index import KVIndex
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.redis_index import RedisIndex
from tests.support import redis_server

_namespaces = itertools.count()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _proc):
        yield url


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[KVIndex]:
    idx: KVIndex
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        url = request.getfixturevalue("redis_url")
        idx = RedisIndex(url, prefix=f"test{next(_namespaces)}:")
    yield idx
    await idx.close()
