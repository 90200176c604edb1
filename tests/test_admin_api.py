"""One admin API and closed-by-default keys on the router, the balancer and the kvstore services.

The apps run in process (lifespan included); the services-mode tests of each area run them
as real processes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from starlette.types import ASGIApp

from switchyard.balancer.service import create_app as balancer_app
from switchyard.balancer.settings import BalancerSettings
from switchyard.kvstore.build import store_from_settings
from switchyard.kvstore.service import create_app as kvstore_app
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.router.server import build_app
from switchyard.router.settings import RouterSettings

KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
WORKER = "http://127.0.0.1:9"  # nothing listens: admin calls need no live engine
TOKENS = list(range(100, 164))

MakeApp = Callable[..., ASGIApp]


class Answer(Protocol):
    """An HTTP response, as the test client returns it."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def router(**keys: Any) -> ASGIApp:
    return build_app(RouterSettings.load(None, policy="round_robin", **keys))


def balancer(**keys: Any) -> ASGIApp:
    return balancer_app(BalancerSettings.load(None, **keys))


def kvstore(**keys: Any) -> ASGIApp:
    settings = KVStoreSettings.load(None, **keys)
    return kvstore_app(store_from_settings(settings), settings)


FLEET_APPS = {"router": router, "balancer": balancer}
ALL_APPS = {**FLEET_APPS, "kvstore": kvstore}
# One change per service that the admin key guards.
ADMIN_CHANGE = {
    "router": ("POST", "/admin/workers", {"url": WORKER}),
    "balancer": ("POST", "/admin/workers", {"url": WORKER}),
    "kvstore": ("POST", "/v1/placements", {"keys": [1, 2], "instance": WORKER}),
}


@pytest.fixture
def serve() -> Iterator[Callable[[ASGIApp], TestClient]]:
    clients: list[TestClient] = []

    def start(app: ASGIApp) -> TestClient:
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def openai_error(resp: Answer, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def admin_call(client: TestClient, service: str, headers: dict[str, str]) -> Answer:
    method, path, body = ADMIN_CHANGE[service]
    return client.request(method, path, json=body, headers=headers)


# -- the same admin calls on the router and the balancer service -----------------------------


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
def test_add_drain_undrain_remove_is_the_same_call_on_router_and_balancer(
    make_app: MakeApp, serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(make_app(admin_api_key=KEY))
    added = client.post("/admin/workers", json={"url": f"{WORKER};models=m"}, headers=ADMIN)
    assert added.status_code == 201
    assert added.json()["id"] == WORKER and added.json()["models"] == ["m"]
    drained = client.post("/admin/workers/drain", params={"url": WORKER}, headers=ADMIN)
    assert drained.status_code == 200 and drained.json()["draining"] is True
    undrained = client.post("/admin/workers/undrain", params={"url": WORKER}, headers=ADMIN)
    assert undrained.status_code == 200 and undrained.json()["draining"] is False
    removed = client.delete("/admin/workers", params={"url": WORKER}, headers=ADMIN)
    assert removed.status_code == 200 and removed.json() == {"removed": WORKER}
    listed = client.get("/admin/workers", headers=ADMIN).json()["workers"]
    assert WORKER not in [w["id"] for w in listed]


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
def test_worker_options_may_be_fields_of_the_body(
    make_app: MakeApp, serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(make_app(admin_api_key=KEY))
    body = {"url": WORKER, "role": "prefill", "dp_size": 2, "models": ["m"]}
    added = client.post("/admin/workers", json=body, headers=ADMIN).json()
    assert added["role"] == "prefill" and len(added["ranks"]) == 2


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
@pytest.mark.parametrize(
    "body",
    [
        {"url": f"{WORKER};flavor=tgi"},
        {"url": f"{WORKER};colour=red"},
        {"url": WORKER, "role": "boss"},
        {"url": WORKER, "dp_size": 0},
        {"spec": WORKER},
        {},
    ],
    ids=["bad-flavor", "unknown-option", "bad-role", "zero-ranks", "unknown-field", "no-url"],
)
def test_a_bad_worker_spec_is_400_in_openai_shape(
    make_app: MakeApp, body: dict[str, Any], serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(make_app(admin_api_key=KEY))
    error = openai_error(client.post("/admin/workers", json=body, headers=ADMIN), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
@pytest.mark.parametrize("method, path", [("POST", "/drain"), ("POST", "/undrain"), ("DELETE", "")])
def test_an_unknown_worker_is_404(
    make_app: MakeApp, method: str, path: str, serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(make_app(admin_api_key=KEY))
    resp = client.request(method, "/admin/workers" + path, params={"url": WORKER}, headers=ADMIN)
    error = openai_error(resp, 404)
    assert error["code"] == "worker_not_found" and error["param"] == "url"


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
def test_a_worker_is_named_by_its_normalised_url(
    make_app: MakeApp, serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(make_app(admin_api_key=KEY))
    client.post("/admin/workers", json={"url": WORKER}, headers=ADMIN)
    loose = WORKER.removeprefix("http://") + "/"
    resp = client.post("/admin/workers/drain", params={"url": loose}, headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["id"] == WORKER


# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ALL_APPS)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"x-api-key": KEY}],
    ids=["missing", "wrong", "not-bearer", "other-header"],
)
def test_a_wrong_or_missing_admin_key_is_401(
    service: str, headers: dict[str, str], serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(ALL_APPS[service](admin_api_key=KEY))
    error = openai_error(admin_call(client, service, headers), 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


@pytest.mark.parametrize("service", ALL_APPS)
def test_the_admin_key_is_accepted(service: str, serve: Callable[[ASGIApp], TestClient]) -> None:
    client = serve(ALL_APPS[service](admin_api_key=KEY))
    assert admin_call(client, service, ADMIN).status_code in (201, 204)


@pytest.mark.parametrize("service", ALL_APPS)
def test_without_an_admin_key_admin_changes_are_refused(
    service: str, serve: Callable[[ASGIApp], TestClient]
) -> None:
    client = serve(ALL_APPS[service]())
    error = openai_error(admin_call(client, service, ADMIN), 403)
    assert error["type"] == "permission_error"
    assert "admin_api_key" in error["message"], "the refusal says how to turn the API on"


@pytest.mark.parametrize("make_app", FLEET_APPS.values(), ids=FLEET_APPS.keys())
def test_without_an_admin_key_the_worker_list_is_refused_too(
    make_app: MakeApp, serve: Callable[[ASGIApp], TestClient]
) -> None:
    openai_error(serve(make_app()).get("/admin/workers"), 403)


@pytest.mark.parametrize("service", ALL_APPS)
def test_startup_says_in_one_line_that_the_admin_api_is_off(
    service: str, serve: Callable[[ASGIApp], TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="switchyard")
    serve(ALL_APPS[service]())
    lines = [r.getMessage() for r in caplog.records if "admin API" in r.getMessage()]
    assert len(lines) == 1 and "off" in lines[0] and "admin_api_key" in lines[0]


def test_the_balancers_old_admin_key_setting_still_turns_the_api_on(
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(balancer(admin_key=KEY))
    assert admin_call(client, "balancer", ADMIN).status_code == 201


def test_kvstore_admin_endpoints_all_need_the_admin_key(
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(kvstore(admin_api_key=KEY))
    calls = [
        ("POST", "/v1/events", {"instance": WORKER, "batch": [0.0, []]}),
        ("POST", "/v1/placements", {"keys": [1], "instance": WORKER}),
        ("POST", "/v1/subscriptions", {"instance": WORKER, "endpoint": "tcp://127.0.0.1:1"}),
        ("DELETE", "/v1/subscriptions?endpoint=tcp://127.0.0.1:1", None),
        ("GET", "/v1/instances", None),
        ("DELETE", "/v1/instances/http%3A%2F%2F127.0.0.1%3A9", None),
    ]
    for method, path, body in calls:
        openai_error(client.request(method, path, json=body), 401)


def test_kvstore_lookup_is_open_while_no_data_key_is_set(
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(kvstore(admin_api_key=KEY))
    assert client.post("/v1/lookup", json={"token_ids": TOKENS}).status_code == 200


def test_kvstore_lookup_needs_the_data_key_when_one_is_set(
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(kvstore(api_key="reader", admin_api_key=KEY))
    body = {"token_ids": TOKENS}
    openai_error(client.post("/v1/lookup", json=body), 401)
    reader = {"Authorization": "Bearer reader"}
    assert client.post("/v1/lookup", json=body, headers=reader).status_code == 200
    assert client.post("/v1/lookup", json=body, headers=ADMIN).status_code == 200
    openai_error(client.post("/v1/placements", json={"keys": [1], "instance": WORKER}), 401)
    placed = client.post("/v1/placements", json={"keys": [1], "instance": WORKER}, headers=reader)
    openai_error(placed, 401)


def test_balancer_picks_and_tickets_need_the_data_key_when_one_is_set(
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(balancer(api_key="router-key", admin_api_key=KEY))
    openai_error(client.post("/v1/pick", json={}), 401)
    openai_error(client.post("/v1/tickets", json={"worker_id": WORKER}), 401)
    openai_error(client.get("/v1/workers"), 401)
    pick = client.post("/v1/pick", json={}, headers={"Authorization": "Bearer router-key"})
    assert openai_error(pick, 503)["code"] == "no_routable_worker"


def test_each_of_several_data_keys_is_accepted(serve: Callable[[ASGIApp], TestClient]) -> None:
    client = serve(router(api_key="alice-key, bob-key"))
    for key in ("alice-key", "bob-key"):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).is_success
    openai_error(client.get("/v1/models", headers={"Authorization": "Bearer alice-key,"}), 401)
    openai_error(client.get("/v1/models"), 401)


@pytest.mark.parametrize(
    "given", ["admin-secreT", "admin-secret2", "admin-secre", "ADMIN-SECRET", " admin-secret x"]
)
def test_a_near_miss_is_a_wrong_key(given: str, serve: Callable[[ASGIApp], TestClient]) -> None:
    client = serve(balancer(admin_api_key=KEY))
    openai_error(admin_call(client, "balancer", {"Authorization": f"Bearer {given}"}), 401)


@pytest.mark.parametrize("service", ALL_APPS)
def test_keys_are_compared_with_hmac_compare_digest(
    service: str, serve: Callable[[ASGIApp], TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    client = serve(ALL_APPS[service](admin_api_key=KEY))
    openai_error(admin_call(client, service, {"Authorization": "Bearer guess"}), 401)
    assert (b"guess", KEY.encode()) in compared


# -- the OpenAI error shape everywhere -----------------------------------------------------------


@pytest.mark.parametrize(
    "service, method, path, body, status",
    [
        ("router", "GET", "/admin/nothing", None, 404),
        ("balancer", "GET", "/nothing", None, 404),
        ("balancer", "POST", "/v1/pick", {"role": "boss"}, 400),
        ("balancer", "POST", "/v1/tickets/none/end", {}, 404),
        ("kvstore", "POST", "/v1/lookup", {}, 400),
        ("kvstore", "POST", "/v1/lookup", {"token_ids": "abc"}, 400),
        ("kvstore", "POST", "/v1/events", {"instance": WORKER, "batch": {"events": 5}}, 400),
        ("kvstore", "POST", "/v1/events", {"batch": []}, 422),
    ],
)
def test_errors_are_in_openai_shape_with_a_string_or_null_code(
    service: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
    serve: Callable[[ASGIApp], TestClient],
) -> None:
    client = serve(ALL_APPS[service](admin_api_key=KEY))
    openai_error(client.request(method, path, json=body, headers=ADMIN), status)
