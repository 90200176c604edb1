"""KV-aware routing end to end: real router, real mock engines, real KV events (or none)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from switchyard.loadtest.prom import values
from tests.router.conftest import StartRouter
from tests.support import TOKENIZER_DIR, Server, eventually, free_port

pytestmark = pytest.mark.timeout(120)

ADMIN = {"authorization": "Bearer adm"}  # the admin API and, with an admin key, /metrics
SYSTEM = "You are a careful assistant who answers in full sentences. " * 120


def chat(turn: int, system: str = SYSTEM) -> dict:
    return {
        "model": "m",
        "max_tokens": 3,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question number {turn}?"},
        ],
    }


@pytest.fixture(scope="module")
def engines() -> Iterator[list[tuple[Server, int]]]:
    started: list[tuple[Server, int]] = []
    try:
        for _ in range(3):
            port, events = free_port(), free_port()
            argv = [
                "mock",
                "--port",
                str(port),
                "--model",
                "m",
                "--speed",
                "100",
                "--kv-events-port",
                str(events),
            ]
            started.append((Server(argv, port).start(), events))
        yield started
    finally:
        for server, _ in started:
            server.stop()


@pytest.fixture(scope="module")
def quiet_engines() -> Iterator[list[Server]]:
    """Mock engines that publish no KV events (their /kv_event_sources is empty)."""
    started: list[Server] = []
    try:
        for _ in range(2):
            port = free_port()
            argv = ["mock", "--port", str(port), "--model", "m", "--speed", "100"]
            started.append(Server(argv, port).start())
        yield started
    finally:
        for server in started:
            server.stop()


def reset(engines: list[tuple[Server, int]]) -> None:
    for server, _ in engines:
        httpx.post(server.url + "/reset_prefix_cache").raise_for_status()


def metric(text: str, name: str) -> float:
    return sum(values(text, name))


def test_a_repeated_long_prefix_returns_to_the_engine_that_holds_it(
    engines: list[tuple[Server, int]], start_router: StartRouter
) -> None:
    reset(engines)
    events = tuple(f"--kv-events={s.url}=tcp://127.0.0.1:{p}" for s, p in engines)
    router = start_router(
        *(s.url for s, _ in engines),
        args=("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR), *events),
    ).url
    served, cached = [], []
    for turn in range(6):
        resp = httpx.post(router + "/v1/chat/completions", json=chat(turn), timeout=30)
        assert resp.status_code == 200
        served.append(resp.headers["x-switchyard-worker"])
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.1)
    assert len(set(served)) == 1
    assert all(c > 1000 for c in cached[1:])
    text = httpx.get(router + "/metrics").text
    assert metric(text, "switchyard_router_kv_estimating") == 0
    assert metric(text, "switchyard_router_fleet_hit_rate") > 0.5
    assert metric(text, "switchyard_router_actual_cached_tokens_total") == sum(cached)


def test_each_turn_of_a_chat_is_predicted_exactly_and_tokenizes_each_message_once(
    engines: list[tuple[Server, int]], start_router: StartRouter
) -> None:
    """A turn's new question is left out of its lookup (no engine can hold it) and
    tokenized after the answer: the predictions still equal what the engine reports.
    (Without parity canaries: each engine's canary chat is tokenized by the same cache and
    would count as a miss whenever it lands before the last lookup.)"""
    reset(engines)
    events = tuple(f"--kv-events={s.url}=tcp://127.0.0.1:{p}" for s, p in engines)
    args = ("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR), "--no-kv-parity")
    router = start_router(*(s.url for s, _ in engines), args=(*args, *events)).url
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(4):
        question = f"Question number {turn}, asked at length: " + "and why? " * 40
        messages.append({"role": "user", "content": question})
        body = {"model": "m", "max_tokens": 40, "messages": messages}
        resp = httpx.post(router + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append(
            {"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]}
        )
        time.sleep(0.2)
    text = httpx.get(router + "/metrics").text
    assert all(c > 1000 for c in cached[1:])
    assert metric(text, "switchyard_router_predicted_cached_tokens_total") == sum(cached)
    misses = values(text, "switchyard_router_tokenize_cache_total", kind="message", outcome="miss")
    # Each distinct message the router was sent once (the mock's answers repeat), the last
    # question too: it is tokenized after its answer, and the counters move at the scrape.
    assert sum(misses) == len({(m["role"], m["content"]) for m in messages[:-1]})


def test_without_kv_flags_events_are_discovered_and_parity_is_verified(
    engines: list[tuple[Server, int]], start_router: StartRouter
) -> None:
    reset(engines)
    router = start_router(
        *(s.url for s, _ in engines),
        args=("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR)),
        config={"router": {"admin_api_key": "adm"}},
    ).url
    served, cached = [], []
    for turn in range(4):
        resp = httpx.post(router + "/v1/chat/completions", json=chat(turn), timeout=30)
        served.append(resp.headers["x-switchyard-worker"])
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.1)
    assert len(set(served)) == 1 and all(c > 1000 for c in cached[1:])
    text = httpx.get(router + "/metrics", headers=ADMIN).text
    assert metric(text, "switchyard_router_kv_estimating") == 0

    def every_engine_checked() -> str | None:
        text = httpx.get(router + "/metrics", headers=ADMIN).text
        return text if len(values(text, "switchyard_router_kv_parity")) == len(engines) else None

    text = eventually(every_engine_checked, 30, 0.2)
    assert values(text, "switchyard_router_kv_parity") == [1.0] * len(engines)
    admin = httpx.get(router + "/admin/workers", headers=ADMIN)
    assert {w["kv_parity"]["reason"] for w in admin.json()["workers"]} == {"verified"}


def test_approximate_mode_without_events_keeps_affinity_and_says_so(
    quiet_engines: list[Server], start_router: StartRouter
) -> None:
    router = start_router(
        *(s.url for s in quiet_engines),
        args=("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR)),
    ).url
    served = []
    for turn in range(5):
        resp = httpx.post(router + "/v1/chat/completions", json=chat(turn), timeout=30)
        served.append(resp.headers["x-switchyard-worker"])
    assert len(set(served)) == 1
    text = httpx.get(router + "/metrics").text
    assert metric(text, "switchyard_router_kv_estimating") == len(quiet_engines)
    other = httpx.post(
        router + "/v1/chat/completions", json=chat(0, system="Different. " * 400), timeout=30
    )
    assert other.status_code == 200


def test_admission_rejects_with_429_when_the_slo_cannot_be_met(
    engines: list[tuple[Server, int]], start_router: StartRouter
) -> None:
    router = start_router(
        *(s.url for s, _ in engines),
        args=("--policy", "kv_aware", "--tokenizer", str(TOKENIZER_DIR)),
        config={"router": {"admission": {"max_wait_ms": 50}}},
    ).url
    body = {**chat(1, system="Fresh context. " * 300), "stream": True}
    with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        resp.read()
    generous = httpx.post(
        router + "/v1/chat/completions", json=chat(2), headers={"x-slo-ttft-ms": "60000"}
    )
    assert generous.status_code == 200
    hopeless = httpx.post(
        router + "/v1/chat/completions",
        json=chat(3, system="Another fresh context. " * 300),
        headers={"x-slo-ttft-ms": "0.001"},
    )
    assert hopeless.status_code == 429
    assert hopeless.json()["error"]["code"] == "slo_unattainable"
    assert int(hopeless.headers["retry-after"]) >= 1
    vip = httpx.post(
        router + "/v1/chat/completions",
        json=chat(4, system="Yet another context. " * 300),
        headers={"x-slo-ttft-ms": "0.001", "x-priority": "high"},
    )
    assert vip.status_code == 200


def test_bad_slo_header_is_400(
    engines: list[tuple[Server, int]], start_router: StartRouter
) -> None:
    router = start_router(*(s.url for s, _ in engines)).url
    resp = httpx.post(
        router + "/v1/chat/completions", json=chat(0), headers={"x-slo-ttft-ms": "soon"}
    )
    assert resp.status_code == 400
