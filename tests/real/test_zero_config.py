"""Real vLLM fronted with worker URLs only: the router and the kvstore find each engine's
KV events through ``/kv_event_sources``, learn its block size (32) from the events, and
hear engines that connect their events to ``--kv-listen``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from switchyard.router.metrics import FLUSH_INTERVAL_S
from tests.real.conftest import MAX_MODEL_LEN, MODEL, reset_caches
from tests.support import TOKENIZER_DIR, Server, free_port, metric
from tools.realvllm import BLOCK_SIZE, EngineOptions, VllmEngine, launch_engine, wait_healthy

PREDICTED = "switchyard_router_predicted_cached_tokens_total"
ACTUAL = "switchyard_router_actual_cached_tokens_total"
STORED = "switchyard_kvstore_blocks_stored_total"
ADMIN = "zero-config-admin"
AUTH = {"authorization": f"Bearer {ADMIN}"}  # the admin API and /metrics


def zero_config_router(workers: list[str], *extra: str) -> Server:
    """``switchyard router --worker U… --tokenizer DIR --policy kv_aware`` and nothing else."""
    port = free_port()
    argv = ["router", "--port", str(port), "--policy", "kv_aware"]
    argv += ["--tokenizer", str(TOKENIZER_DIR), "--admin-api-key", ADMIN, *extra]
    for url in workers:
        argv += ["--worker", url]
    return Server(argv, port, "/ready").start(timeout=60)


def parity_of(router: Server, timeout_s: float = 120.0) -> dict[str, dict]:
    """Each worker's parity check once every one has a verdict."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.get(router.url + "/admin/workers", headers=AUTH)
        workers = resp.json()["workers"]
        done = {
            w["id"]: w["kv_parity"] for w in workers if (w["kv_parity"] or {}).get("ok") is not None
        }
        if len(done) == len(workers):
            return done
        assert time.monotonic() < deadline, f"no parity verdict in time: {workers}"
        time.sleep(0.5)


def blocks_stored(router: Server) -> float:
    return metric(httpx.get(router.url + "/metrics", headers=AUTH, timeout=10).text, STORED)


def wait_stored(router: Server, before: float, blocks: int, timeout_s: float = 30.0) -> None:
    """Until the router has indexed ``blocks`` more blocks from the engines' events (a
    fixed pause was too short while other engines loaded the cores)."""
    deadline = time.monotonic() + timeout_s
    while blocks_stored(router) < before + blocks and time.monotonic() < deadline:
        time.sleep(0.1)


def settled_metrics(router: Server) -> str:
    """/metrics once every process has written what it counted: under ``--processes`` (the
    default) each writes its samples within ``FLUSH_INTERVAL_S``, and the one that answers
    need not be the one that served the request."""
    time.sleep(2 * FLUSH_INTERVAL_S)
    return httpx.get(router.url + "/metrics", headers=AUTH, timeout=10).text


def counters(router: Server) -> tuple[float, float]:
    text = settled_metrics(router)
    return metric(text, PREDICTED), metric(text, ACTUAL)


def test_worker_urls_alone_route_each_conversation_to_the_engine_that_holds_it(
    pair: list[VllmEngine],
) -> None:
    reset_caches(pair)
    with zero_config_router([e.url for e in pair]) as router:
        verdicts = parity_of(router)
        assert {v["block_size"] for v in verdicts.values()} == {BLOCK_SIZE}
        assert all(v["ok"] for v in verdicts.values()), verdicts
        text = settled_metrics(router)
        assert metric(text, "switchyard_router_kv_estimating") == 0
        assert metric(text, "switchyard_router_kv_parity") == len(pair)
        background = "You answer questions about rivers and harbours in full sentences. " * 30
        for conv in range(2):
            messages = [{"role": "system", "content": f"Conversation {conv}. {background}"}]
            served = set()
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn}: item {turn * 7}?"})
                before = counters(router)
                stored = blocks_stored(router)
                resp = httpx.post(
                    router.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 4},
                    timeout=120,
                )
                assert resp.status_code == 200, resp.text
                body = resp.json()
                served.add(resp.headers["x-switchyard-worker"])
                after = counters(router)
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert after[1] - before[1] == cached
                assert abs((after[0] - before[0]) - cached) <= BLOCK_SIZE
                if turn:
                    assert cached >= BLOCK_SIZE * 20
                messages.append(body["choices"][0]["message"])
                new_blocks = (body["usage"]["prompt_tokens"] - cached) // BLOCK_SIZE
                wait_stored(router, stored, new_blocks)
            assert len(served) == 1


def test_a_router_started_after_a_chat_routes_its_repeat_to_the_engine_that_holds_it(
    pair: list[VllmEngine],
) -> None:
    reset_caches(pair)
    holder = pair[1]
    content = "Before the router started: lighthouses, tides and charts. " * 40
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    first = httpx.post(holder.url + "/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    prompt_blocks = first.json()["usage"]["prompt_tokens"] // BLOCK_SIZE
    time.sleep(1.0)  # the engine publishes its events after the step
    # Two processes: the one that follows the events catches up and shares what it learns
    # (each counts the blocks); no parity canaries, whose blocks would count too. Waiting
    # for one process's blocks would let the repeat reach the other before it knew them.
    processes = 2
    argv = ("--processes", str(processes), "--no-kv-parity")
    with zero_config_router([e.url for e in pair], *argv) as router:
        # Caught up from the engine's replay buffer, not from live events, in both.
        wait_stored(router, 0, processes * prompt_blocks)
        before = counters(router)
        again = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert again.headers["x-switchyard-worker"] == holder.url
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = counters(router)[0] - before[0]
        assert cached >= BLOCK_SIZE * (prompt_blocks - 1)
        assert abs(predicted - cached) <= BLOCK_SIZE


def test_a_kvstore_given_worker_urls_indexes_their_events_in_the_engines_block_size(
    pair: list[VllmEngine], tmp_path: Path
) -> None:
    engine = pair[0]
    reset_caches(pair)
    port = free_port()
    argv = ["kvstore", "--port", str(port), "--tokenizer", str(TOKENIZER_DIR)]
    with Server([*argv, "--worker", engine.url], port).start(timeout=60) as kvstore:
        messages = [
            {"role": "system", "content": "You explain tides to sailors, briefly. " * 25},
            {"role": "user", "content": "When is the water highest?"},
        ]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        deadline = time.monotonic() + 60
        while True:
            httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
            lookup = httpx.post(
                kvstore.url + "/v1/lookup",
                json={"model": MODEL, "messages": messages, "candidates": [engine.url]},
                timeout=10,
            ).json()
            if lookup["matches"]:
                break
            assert time.monotonic() < deadline, lookup
            time.sleep(1.0)
        cached = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120).json()
        (match,) = lookup["matches"]
        assert lookup["block_size"] == BLOCK_SIZE and match["instance"] == engine.url
        assert (
            0
            <= match["matched_tokens"] - cached["usage"]["prompt_tokens_details"]["cached_tokens"]
            <= BLOCK_SIZE
        )


@pytest.fixture(scope="module")
def connecting_engine(
    pair: list[VllmEngine], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmEngine, str]]:
    """An engine whose PUB socket connects to ``tcp://127.0.0.1:P`` (llm-d's layout)."""
    listen = f"tcp://127.0.0.1:{free_port()}"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": listen,
        "replay_endpoint": f"tcp://*:{free_port()}",
        "topic": f"kv@127.0.0.1@{MODEL}",
    }
    opts = EngineOptions(
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
        extra_args=["--kv-events-config", json.dumps(events)],
    )
    engine = launch_engine(tiny_model, "1", opts, tmp_path_factory.mktemp("connect-logs"))
    try:
        wait_healthy([engine], timeout_s=800)
        yield engine, listen
    finally:
        engine.stop()


def test_an_engine_that_connects_its_events_is_heard_on_kv_listen(
    connecting_engine: tuple[VllmEngine, str],
) -> None:
    engine, listen = connecting_engine
    sources = httpx.get(engine.url + "/kv_event_sources").json()
    assert sources["0"]["endpoint"] == listen
    with zero_config_router([engine.url], "--kv-listen", listen) as router:
        verdict = parity_of(router)[engine.url]
        assert verdict["ok"] is True and verdict["block_size"] == BLOCK_SIZE, verdict
        assert verdict["event_tokens"] == verdict["predicted_cached_tokens"] > 0
