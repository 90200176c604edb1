"""The kvstore service over HTTP (real process, real Redis) and degraded mode."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
from fastapi.testclient import TestClient

from switchyard.kvstore.allowlist import EndpointAllowList
from switchyard.kvstore.index import Location
from switchyard.kvstore.redis_index import RedisIndex
from switchyard.kvstore.remote import RemoteKVStore
from switchyard.kvstore.service import create_app
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from tests.support import TOKENIZER_DIR, Server, eventually_async, free_port, redis_server

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"
TOKENS = list(range(200, 264))
ADMIN_KEY = "kv-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(autouse=True)
def admin_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kvstore service started here takes events and placements (off without a key)."""
    monkeypatch.setenv("SWITCHYARD_KVSTORE_ADMIN_API_KEY", ADMIN_KEY)


def stored_batch(tokens: list[int], first_hash: int) -> list:
    hashes = list(range(first_hash, first_hash + len(tokens) // 16))
    return [time.time(), [["BlockStored", hashes, None, tokens, 16, None, "GPU"]], 0]


async def test_service_on_redis_serves_pushes_lookups_instances_and_deletes() -> None:
    with redis_server() as (url, redis_proc):
        port = free_port()
        args = ["kvstore", "--port", str(port), "--redis", url, "--tokenizer", str(TOKENIZER_DIR)]
        with Server(args, port) as svc:
            pushed = httpx.post(
                svc.url + "/v1/events",
                json={"instance": E, "seq": 0, "batch": stored_batch(TOKENS, 1)},
                headers=ADMIN,
            )
            assert pushed.status_code == 204
            raw = msgpack.packb(stored_batch(TOKENS[:32], 50))
            pushed = httpx.post(
                svc.url + "/v1/events",
                params={"instance": "http://127.0.0.1:8002", "seq": 0},
                content=raw,
                headers={"content-type": "application/msgpack", **ADMIN},
            )
            assert pushed.status_code == 204

            remote = RemoteKVStore(svc.url, block_size=16, timeout_s=2.0, api_key=ADMIN_KEY)
            await remote.start()
            try:
                res = await remote.lookup(None, token_ids=TOKENS)
                assert [(m.instance, m.matched_tokens) for m in res.matches] == [
                    (E, 64),
                    ("http://127.0.0.1:8002", 32),
                ]
                assert len(res.keys) == 4 and not res.degraded
                await remote.clear_instance(E)
                res = await remote.lookup(None, token_ids=TOKENS)
                assert [m.instance for m in res.matches] == ["http://127.0.0.1:8002"]
                await remote.record_placement(res.keys, E, ttl_s=5)
                res = await remote.lookup(None, token_ids=TOKENS, candidates=[E])
                assert [(m.instance, m.matched_tokens) for m in res.matches] == [(E, 64)]
            finally:
                await remote.stop()

            instances = httpx.get(svc.url + "/v1/instances", headers=ADMIN).json()
            assert {i["instance"] for i in instances} >= {E, "http://127.0.0.1:8002"}
            metrics = httpx.get(svc.url + "/metrics").text
            assert "switchyard_kvstore_lookups_total" in metrics
            assert "switchyard_kvstore_events_total 2.0" in metrics

            redis_proc.kill()
            redis_proc.wait()
            answer = httpx.post(svc.url + "/v1/lookup", json={"token_ids": TOKENS})
            assert answer.status_code == 200
            assert answer.json()["degraded"] and answer.json()["matches"] == []


async def test_service_tokenizes_chat_and_prompt_alike() -> None:
    port = free_port()
    with Server(["kvstore", "--port", str(port), "--tokenizer", str(TOKENIZER_DIR)], port) as svc:
        messages = [{"role": "user", "content": "tell me about blocks " * 10}]
        chat = httpx.post(svc.url + "/v1/lookup", json={"messages": messages, "include_keys": True})
        text = "<|im_start|>user\n" + "tell me about blocks " * 10 + "<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        prompt = httpx.post(svc.url + "/v1/lookup", json={"prompt": text, "include_keys": True})
        assert chat.json()["keys"] == prompt.json()["keys"] and chat.json()["exact"]
        assert httpx.post(svc.url + "/v1/lookup", json={}).status_code == 400


async def test_redis_outage_gives_degraded_answers_then_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="switchyard.kvstore")
    with redis_server(port) as (url, proc):
        store = KVStore(RedisIndex(url), block_size=16, probe_interval_s=0.05)
        await store.start()
        keys = store.keys_for(TOKENS)
        await store.index.add(keys, Location(E))
        assert (await store.lookup(None, token_ids=TOKENS)).matches
        proc.kill()
        proc.wait()
        for _ in range(5):
            t0 = time.perf_counter()
            res = await store.lookup(None, token_ids=TOKENS)
            assert time.perf_counter() - t0 < 0.05
            assert res.degraded and res.matches == []
        await store.record_placement(keys, E)  # dropped, not raised
        incidents = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(incidents) == 1
    with redis_server(port):
        await eventually_async(lambda: not store.degraded, 5, 0.05)
        await store.record_placement(keys, E)
        res = await store.lookup(None, token_ids=TOKENS)
        assert not res.degraded and res.matches[0].matched_tokens == 64
        await store.stop()


async def test_events_that_arrived_while_redis_was_down_are_in_the_index_once_it_returns() -> None:
    port = free_port()
    kept, evicted = TOKENS, list(range(500, 532))
    with redis_server(port) as (url, proc):
        store = KVStore(RedisIndex(url), block_size=16, probe_interval_s=0.05)
        await store.start()
        await store.ingest(E, stored_batch(kept, 1), seq=0)
        await store.ingest(E, stored_batch(evicted, 100), seq=1)
        proc.kill()
        proc.wait()
        late = list(range(700, 748))
        await store.ingest(E, stored_batch(late, 200), seq=2)
        removal = [time.time(), [["BlockRemoved", [100, 101], "GPU"]], 0]
        await store.ingest(E, removal, seq=3)
        assert store.degraded
    with redis_server(port):  # a new Redis: the outage also lost what was written before
        await eventually_async(lambda: not store.degraded, 5, 0.05)
        matched = {}
        for name, tokens in (("kept", kept), ("evicted", evicted), ("late", late)):
            res = await store.lookup(None, token_ids=tokens)
            assert not res.degraded
            matched[name] = max((m.matched_tokens for m in res.matches), default=0)
        assert matched == {"kept": 64, "evicted": 0, "late": 48}
        await store.stop()


async def test_an_unreachable_kvstore_service_is_degraded_not_an_error() -> None:
    remote = RemoteKVStore(f"http://127.0.0.1:{free_port()}", block_size=16, timeout_s=0.02)
    await remote.start()
    try:
        res = await remote.lookup(None, token_ids=TOKENS)
        assert res.degraded and res.matches == []
    finally:
        await remote.stop()


def test_the_service_api_is_openapi_documented() -> None:
    paths = create_app(KVStore(block_size=16)).openapi()["paths"]
    assert {"/v1/lookup", "/v1/events", "/v1/instances", "/v1/instances/{instance}"} <= set(paths)
    assert "delete" in paths["/v1/instances/{instance}"]


# -- what a caller holding the admin key can and cannot make the store do ---------------------


@pytest.fixture
def kv_client() -> Iterator[TestClient]:
    settings = KVStoreSettings.load(None, admin_api_key=ADMIN_KEY, workers=["http://10.1.2.3:8000"])
    with TestClient(
        create_app(KVStore(block_size=16), settings), raise_server_exceptions=False
    ) as client:
        yield client


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def subscribe(client: TestClient, endpoint: str) -> httpx.Response:
    body = {"instance": E, "endpoint": endpoint}
    return client.post("/v1/subscriptions", json=body, headers=ADMIN)


def test_a_subscription_to_a_host_outside_the_fleet_is_refused(kv_client: TestClient) -> None:
    outside = ("tcp://169.254.169.254:80", "tcp://10.9.9.9:5557", "tcp://redis:6379", "ipc:///x")
    for endpoint in outside:
        error = error_of(subscribe(kv_client, endpoint), 403)
        assert error["code"] == "endpoint_not_allowed" and error["param"] == "endpoint"


def test_subscriptions_to_loopback_and_the_configured_workers_host_are_taken(
    kv_client: TestClient,
) -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://localhost:5558", "tcp://10.1.2.3:5557"):
        assert subscribe(kv_client, endpoint).status_code == 204


def test_an_endpoint_that_is_not_tcp_host_port_is_a_400(kv_client: TestClient) -> None:
    for endpoint in ("http://127.0.0.1:80", "tcp://127.0.0.1", ""):
        assert error_of(subscribe(kv_client, endpoint), 400)["param"] == "endpoint"


def test_a_replay_endpoint_outside_the_fleet_is_refused(kv_client: TestClient) -> None:
    body = {
        "instance": E,
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://192.168.0.1:5558",
    }
    resp = kv_client.post("/v1/subscriptions", json=body, headers=ADMIN)
    assert error_of(resp, 403)["param"] == "replay_endpoint"


def test_subscription_hosts_widen_the_allow_list() -> None:
    settings = KVStoreSettings.load(
        None, admin_api_key=ADMIN_KEY, subscription_hosts=["10.0.0.0/8", "engine-a"]
    )
    allowed = EndpointAllowList.from_settings(settings)
    assert allowed.allows("tcp://10.200.1.1:5557") and allowed.allows("tcp://engine-a:5557")
    assert not allowed.allows("tcp://11.0.0.1:5557") and not allowed.allows("tcp://engine-b:1")
    assert EndpointAllowList(["*"]).allows("tcp://anywhere:1")


async def test_unsubscribing_a_publisher_whose_feed_failed_is_not_an_error() -> None:
    store = KVStore(block_size=16)
    await store.start()
    try:
        store.subscribe(E, "tcp://no such host:5557")  # connect fails inside the feed's task
        await asyncio.sleep(0.05)
        await store.unsubscribe("tcp://no such host:5557")
        assert store.feeds() == []
    finally:
        await store.stop()


def test_a_chat_part_whose_text_is_not_a_string_is_a_400(kv_client: TestClient) -> None:
    for content in ([{"type": "text", "text": 5}], 5, [{"text": "no type"}]):
        body = {"messages": [{"role": "user", "content": content}]}
        error = error_of(kv_client.post("/v1/lookup", json=body), 400)
        assert error["param"] and error["param"].startswith("messages")


def test_token_ids_and_placement_keys_outside_their_ranges_are_400s(
    kv_client: TestClient,
) -> None:
    placement = {"keys": [2**64], "instance": E}
    errors = [
        error_of(kv_client.post("/v1/lookup", json={"token_ids": [-1]}), 400),
        error_of(kv_client.post("/v1/lookup", json={"token_ids": [2**32]}), 400),
        error_of(kv_client.post("/v1/placements", json=placement, headers=ADMIN), 400),
    ]
    assert [e["type"] for e in errors] == ["invalid_request_error"] * 3
