"""Schemathesis over each service's OpenAPI schema: no operation answers 5xx to any input.

Each service runs in-process (ASGI) with an admin key and a data key, and every call
carries the admin key, so generated inputs reach the handlers rather than stopping at
the key check. Examples per operation are bounded to keep the whole set fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from starlette.types import ASGIApp

from switchyard.balancer.service import create_app as balancer_app
from switchyard.balancer.settings import BalancerSettings
from switchyard.kvstore.build import store_from_settings
from switchyard.kvstore.service import create_app as kvstore_app
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.router.server import build_app
from switchyard.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY = "fuzz-admin"
DATA_KEY = "fuzz-data"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER = "http://127.0.0.1:9"  # nothing listens there: a worker that is never routable
EXAMPLES = int(os.environ.get("SWITCHYARD_FUZZ_EXAMPLES", "15"))


def router() -> ASGIApp:
    return build_app(
        RouterSettings.load(
            None,
            policy="round_robin",
            workers=[WORKER],
            admin_api_key=ADMIN_KEY,
            api_key=DATA_KEY,
        )
    )


def balancer() -> ASGIApp:
    return balancer_app(
        BalancerSettings.load(None, workers=[WORKER], admin_api_key=ADMIN_KEY, api_key=DATA_KEY)
    )


def kvstore() -> ASGIApp:
    kv = KVStoreSettings.load(None, admin_api_key=ADMIN_KEY, api_key=DATA_KEY)
    return kvstore_app(store_from_settings(kv), kv)


SERVICES: dict[str, Callable[[], ASGIApp]] = {
    "router": router,
    "balancer": balancer,
    "kvstore": kvstore,
}


def operations(make: Callable[[], ASGIApp]) -> list[tuple[str, str]]:
    """(method, path) of every operation the service documents."""
    with TestClient(make()) as client:
        spec = client.get("/openapi.json", headers=AUTH).json()
    return [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]


CASES = [
    pytest.param(name, method, path, id=f"{name} {method} {path}")
    for name, make in SERVICES.items()
    for method, path in operations(make)
]


# 503s that state a fact about the fleet (no worker is routable: none listens), not a fault.
FLEET_STATE_CODES = {"no_routable_worker"}


def fleet_state_answer(path: str, status: int, body: bytes) -> bool:
    """A 503 that states the fleet has no routable worker: /ready's contract, or an error."""
    if status != 503:
        return False
    if path == "/ready":
        return True
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return code in FLEET_STATE_CODES


@pytest.fixture(scope="module")
def running() -> Iterator[dict[str, TestClient]]:
    """Each service started once (its lifespan run) and called through one client."""
    clients = {
        name: TestClient(make(), raise_server_exceptions=False) for name, make in SERVICES.items()
    }
    for client in clients.values():
        client.__enter__()
    yield clients
    for client in clients.values():
        client.__exit__(None, None, None)


def with_admin_key(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generated request with the admin key as its only Authorization header."""
    headers = {k: v for k, v in kwargs.get("headers", {}).items() if k.lower() != "authorization"}
    call = {k: v for k, v in kwargs.items() if k in ("method", "url", "params", "json", "cookies")}
    if "data" in kwargs:
        call["content"] = kwargs["data"]
    return {**call, "headers": {**headers, **AUTH}}


@pytest.mark.parametrize(("service", "method", "path"), CASES)
def test_no_operation_answers_5xx(
    service: str, method: str, path: str, running: dict[str, TestClient]
) -> None:
    client = running[service]
    spec = client.get("/openapi.json", headers=AUTH).json()
    operation = schemathesis.openapi.from_dict(spec)[path][method]
    failures: list[str] = []

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def probe(case: schemathesis.Case) -> None:
        call = with_admin_key(case.as_transport_kwargs(base_url="http://testserver"))
        resp = client.request(**call)
        if resp.status_code >= 500 and not fleet_state_answer(path, resp.status_code, resp.content):
            failures.append(f"{call} -> {resp.status_code} {resp.text[:300]}")

    probe()
    assert not failures, "\n".join(failures[:5])
