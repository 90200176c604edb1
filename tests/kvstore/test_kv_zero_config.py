"""Zero configuration: publishers found through vLLM's /kv_event_sources, block sizes learned
from the events, engines that connect to one bound socket, bare --subscribe endpoints."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import pytest
import zmq
from fastapi.testclient import TestClient

from switchyard.cli.main import run
from switchyard.kvstore.discovery import parse_sources, reachable
from switchyard.kvstore.events import BlockStored as WireStored
from switchyard.kvstore.events import EventBatch
from switchyard.kvstore.listener import TopicMap
from switchyard.kvstore.service import create_app
from switchyard.kvstore.settings import KVStoreSettings, parse_subscription
from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.kvevents import KVEventPublisher
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.support import TOKENIZER_DIR, Server, eventually, eventually_async, free_port

pytestmark = pytest.mark.timeout(30)

A = "http://127.0.0.1:8001"
B = "http://127.0.0.1:8002"


def stored(tokens: list[int], size: int, first_hash: int = 1) -> EventBatch:
    n = len(tokens) // size
    return EventBatch(
        time.time(), [WireStored(list(range(first_hash, first_hash + n)), None, tokens, size)]
    )


# -- /kv_event_sources -----------------------------------------------------------------------


def test_sources_of_every_rank_are_read_with_the_wildcard_host_replaced_by_the_workers() -> None:
    body = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "",
        },
        "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": None},
    }
    sources = parse_sources("http://10.0.0.7:8000", body)
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint) for s in sources] == [
        (0, "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"),
        (1, "tcp://10.0.0.7:5558", None),
    ]
    assert all(s.engine_binds for s in sources)


def test_a_rank_without_a_zmq_publisher_is_no_source() -> None:
    assert parse_sources(A, {"0": {"enable_kv_cache_events": False, "publisher": "null"}}) == []
    assert parse_sources(A, {}) == []


def test_an_endpoint_naming_a_host_is_one_the_engine_connects_to() -> None:
    (src,) = parse_sources(A, {"0": {"publisher": "zmq", "endpoint": "tcp://collector:5557"}})
    assert not src.engine_binds and src.endpoint == "tcp://collector:5557"


def test_ipv6_wildcards_become_the_workers_host() -> None:
    assert reachable("tcp://[::]:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert reachable("tcp://0.0.0.0:5557", A) == "tcp://127.0.0.1:5557"


def sources_engine(body: object, status: int = 200, port: int = 0) -> StubBackend:
    """An engine answering ``GET /kv_event_sources`` with ``body``; not yet listening."""

    async def route(request: StubRequest) -> StubReply | None:
        if request.method == "GET" and request.path == "/kv_event_sources":
            return StubReply.json(body, status)
        return None

    return StubBackend(route, port)


async def serve_sources(body: object, status: int = 200) -> tuple[StubBackend, str]:
    engine = sources_engine(body, status)
    await engine.open()
    return engine, engine.url


async def test_a_worker_url_alone_is_enough_to_follow_its_events_and_learn_its_block_size() -> None:
    events = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{events}")
    body = {"0": {"publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": ""}}
    runner, url = await serve_sources(body)
    store = KVStore(block_size=16)
    follower = store.follow_workers([url])
    await store.start()
    try:
        await follower.wait()
        assert follower.endpoints[url] == [f"tcp://127.0.0.1:{events}"]
        tokens = list(range(64))

        async def indexed() -> bool:
            pub.publish(KVEventBatch(time.time(), [BlockStored([1, 2], None, tokens, 32)]))
            return bool((await store.lookup(None, token_ids=tokens)).matches)

        await eventually_async(indexed, 5.0, 0.05)
        assert store.block_size_of(url) == 32
        (match,) = (await store.lookup(None, token_ids=tokens)).matches
        assert (match.instance, match.matched_tokens) == (url, 64)
    finally:
        pub.close()
        await store.stop()
        await runner.close()


async def test_a_worker_that_is_not_up_yet_is_asked_again() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = KVStore(block_size=16)
    follower = store.follow_workers([url])
    follower.discovery.retry_s = 0.05
    await store.start()
    engine = sources_engine({"0": {"publisher": "zmq", "endpoint": "tcp://*:5999"}}, port=port)
    try:
        await asyncio.sleep(0.2)
        assert url not in follower.endpoints
        await engine.open()
        await asyncio.wait_for(follower.wait(), 5)
        assert follower.endpoints[url] == ["tcp://127.0.0.1:5999"]
    finally:
        await store.stop()
        await engine.close()


async def test_an_engine_without_the_route_is_left_to_approximate_mode() -> None:
    runner, url = await serve_sources({"detail": "Not Found"}, status=404)
    store = KVStore(block_size=16)
    follower = store.follow_workers([url])
    await store.start()
    try:
        await asyncio.wait_for(follower.wait(), 5)
        assert follower.endpoints == {} and store.feeds() == []
    finally:
        await store.stop()
        await runner.close()


# -- block sizes -----------------------------------------------------------------------------


async def test_instances_with_different_block_sizes_are_matched_each_in_its_own() -> None:
    store = KVStore(block_size=16)
    tokens = list(range(128))
    await store.ingest(A, stored(tokens, 16))
    await store.ingest(B, stored(tokens[:96], 32, first_hash=100))
    assert store.instance_block_sizes == {A: 16, B: 32}
    result = await store.lookup(None, token_ids=tokens, candidates=[A, B])
    assert {m.instance: m.matched_tokens for m in result.matches} == {A: 128, B: 96}
    assert len(result.keys_for(A)) == 8 and len(result.keys_for(B)) == 4
    everyone = await store.lookup(None, token_ids=tokens)
    assert {m.instance: m.matched_tokens for m in everyone.matches} == {A: 128, B: 96}


async def test_a_placement_is_recorded_in_the_workers_block_size() -> None:
    store = KVStore(block_size=16)
    await store.ingest(B, stored(list(range(32)), 32))
    tokens = list(range(1000, 1128))
    first = await store.lookup(None, token_ids=tokens, candidates=[A, B])
    await store.record_placement(first.keys_for(B), B)
    again = await store.lookup(None, token_ids=tokens, candidates=[A, B])
    assert {m.instance: m.matched_tokens for m in again.matches} == {B: 128}


async def test_an_instance_is_keyed_in_the_default_size_until_its_events_say_otherwise() -> None:
    store = KVStore(block_size=16)
    assert store.block_size_of(A) == 16
    await store.ingest(A, stored(list(range(64)), 64))
    assert store.block_size_of(A) == 64


async def test_a_restarted_publisher_may_come_back_with_another_block_size() -> None:
    store = KVStore(block_size=16)
    await store.ingest(A, stored(list(range(32)), 32), seq=5)
    await store.ingest(A, stored(list(range(64)), 64), seq=0)
    assert store.block_size_of(A) == 64
    result = await store.lookup(None, token_ids=list(range(64)), candidates=[A])
    assert [m.matched_tokens for m in result.matches] == [64]


# -- engines that connect (--kv-listen) ------------------------------------------------------


def test_a_topic_names_its_instance_by_mapping_by_url_or_by_a_unique_llm_d_host() -> None:
    topics = TopicMap()
    topics.add_worker("http://10.0.0.5:8000")
    topics.add_worker("http://10.0.0.6:8000")
    topics.map("engine-a", "http://10.0.0.6:8000", 1)
    assert topics.resolve("engine-a") is not None
    assert topics.resolve("engine-a").dp_rank == 1  # type: ignore[union-attr]
    assert topics.resolve("http://10.0.0.9:8000/").instance == "http://10.0.0.9:8000"  # type: ignore[union-attr]
    assert topics.resolve("kv@10.0.0.5@llama").instance == "http://10.0.0.5:8000"  # type: ignore[union-attr]
    assert topics.resolve("kv@10.0.0.99@llama") is None
    assert TopicMap().resolve("kv@10.0.0.99@llama").instance == "kv@10.0.0.99@llama"  # type: ignore[union-attr]


def batch_frames(topic: bytes, seq: int, tokens: list[int], size: int) -> list[bytes]:
    event = ["BlockStored", [seq + 1], None, tokens, size, None, "GPU"]
    payload = msgpack.packb([time.time(), [event]], use_bin_type=True)
    return [topic, seq.to_bytes(8, "big"), payload]


async def test_engines_that_connect_are_told_apart_by_their_llm_d_topic() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    store = KVStore(block_size=16)
    store.topics.add_worker("http://127.0.0.1:8001")
    store.listen(endpoint)
    await store.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)
    try:
        tokens = list(range(32))

        async def indexed() -> bool:
            pub.send_multipart(batch_frames(b"kv@127.0.0.1@llama", 0, tokens, 32))
            pub.send_multipart(batch_frames(b"kv@10.9.9.9@llama", 0, tokens, 32))
            return bool((await store.lookup(None, token_ids=tokens)).matches)

        await eventually_async(indexed, 5.0, 0.05)
        (match,) = (await store.lookup(None, token_ids=tokens)).matches
        assert match.instance == "http://127.0.0.1:8001" and match.matched_tokens == 32
        assert store.block_size_of("http://127.0.0.1:8001") == 32
        assert [f.source for f in store.feeds()] == ["listen"]
    finally:
        pub.close(linger=0)
        ctx.term()
        await store.stop()


async def test_a_listen_address_in_use_fails_the_start() -> None:
    port = free_port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    store = KVStore(block_size=16)
    store.listen(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(OSError, match="cannot bind"):
            await store.start()
    finally:
        holder.close(linger=0)
        ctx.term()
        await store.stop()


# -- flags -----------------------------------------------------------------------------------


def test_a_bare_subscribe_endpoint_names_its_own_instance() -> None:
    sub = parse_subscription("tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")
    assert (sub.instance, sub.endpoint, sub.replay_endpoint) == (
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5558",
    )
    named = parse_subscription("http://e:8000=tcp://e:5557,rank=2")
    assert (named.instance, named.dp_rank) == ("http://e:8000", 2)


def test_the_kvstore_settings_take_workers_and_a_listen_address() -> None:
    s = KVStoreSettings.load(None, workers=["10.0.0.5:8000/"], kv_listen="tcp://0.0.0.0:5557")
    assert s.workers == ["http://10.0.0.5:8000"] and s.kv_listen == "tcp://0.0.0.0:5557"


@pytest.mark.parametrize(
    "argv",
    [
        ["--subscribe", "tcp://"],
        ["--subscribe", "10.0.0.5:5557"],
        ["--subscribe", "tcp://h:1,rank=x"],
        ["--subscribe", "tcp://h:1,flavor=trt"],
        ["--kv-listen", "5557"],
        ["--worker", "ftp://x"],
        ["--block-size", "0"],
    ],
)
def test_a_bad_kvstore_flag_value_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["kvstore", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("switchyard kvstore:")


async def test_the_service_lookup_carries_each_candidates_keys_in_its_block_size() -> None:
    store = KVStore(block_size=16)
    tokens = list(range(128))
    await store.ingest(B, stored(tokens[:64], 32))
    with TestClient(create_app(store)) as client:
        body = {"token_ids": tokens, "candidates": [A, B], "include_keys": True}
        answer = client.post("/v1/lookup", json=body).json()
    assert answer["block_size"] == 16 and answer["instance_block_sizes"] == {B: 32}
    assert len(answer["keys"]) == 8 and len(answer["sized_keys"]["32"]) == 4
    assert {m["instance"]: m["matched_tokens"] for m in answer["matches"]} == {B: 64}


def test_the_kvstore_service_given_a_worker_url_indexes_its_events() -> None:
    port, kv_port = free_port(), free_port()
    argv = ["mock", "--port", str(port), "--model", "m", "--speed", "100"]
    argv += ["--kv-events-port", str(free_port()), "--block-size", "32"]
    with Server(argv, port).start() as engine:
        service = ["kvstore", "--port", str(kv_port), "--tokenizer", str(TOKENIZER_DIR)]
        with Server([*service, "--worker", engine.url], kv_port).start() as kvstore:
            messages = [{"role": "user", "content": "Tell me about harbours. " * 40}]

            def matched() -> dict | None:
                body = {"model": "m", "messages": messages, "max_tokens": 1}
                httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10)
                time.sleep(0.2)  # the engine's events reach the kvstore
                lookup = httpx.post(
                    kvstore.url + "/v1/lookup",
                    json={"model": "m", "messages": messages, "candidates": [engine.url]},
                ).json()
                return lookup if lookup.get("matches") else None

            lookup = eventually(matched, 20, 0)
            (match,) = lookup["matches"]
            assert lookup["block_size"] == 32 and match["instance"] == engine.url
            assert match["matched_tokens"] == lookup["total_tokens"] // 32 * 32
