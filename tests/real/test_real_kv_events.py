"""vLLM's own KV events feed the router's index and a kvstore service."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import yaml
import zmq

from switchyard.loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MODEL, reset_caches
from tests.support import TOKENIZER_DIR, Server, eventually, free_port, metric
from tools.realvllm import BLOCK_SIZE, VllmEngine

PREDICTED = "switchyard_router_predicted_cached_tokens_total"
ACTUAL = "switchyard_router_actual_cached_tokens_total"


def conversation(topic: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You explain {topic} to engineers, briefly. " * 25},
        {"role": "user", "content": f"What matters most about {topic}?"},
    ]


def chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def counters(router: Server) -> tuple[float, float]:
    admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
    text = httpx.get(router.url + "/metrics", headers=admin, timeout=10).text
    return metric(text, PREDICTED), metric(text, ACTUAL)


def test_a_repeated_chat_returns_to_the_engine_whose_events_announced_it(router: Server) -> None:
    messages = conversation("bridges")
    first = chat(router.url, messages)
    time.sleep(1.0)  # the engine publishes its events after the step
    served = {chat(router.url, messages).headers["x-switchyard-worker"] for _ in range(3)}
    assert served == {first.headers["x-switchyard-worker"]}


def test_the_routers_predicted_cached_tokens_equal_the_engines_within_one_block(
    router: Server,
) -> None:
    messages = conversation("compilers")
    chat(router.url, messages)
    time.sleep(1.0)
    predicted_before, actual_before = counters(router)
    again = chat(router.url, messages).json()
    predicted, actual = counters(router)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and actual - actual_before == cached
    assert abs((predicted - predicted_before) - cached) < BLOCK_SIZE


def kvstore_service(tmp_path: Path, subscribe: str) -> Server:
    port = free_port()
    config = tmp_path / f"kvstore-{port}.yaml"
    config.write_text(yaml.safe_dump({"kvstore": {"block_size": BLOCK_SIZE}}))
    argv = ["kvstore", "--port", str(port), "--config", str(config)]
    argv += ["--tokenizer", str(TOKENIZER_DIR), "--subscribe", subscribe]
    return Server(argv, port).start(timeout=60)


def matched_tokens(kvstore: Server, instance: str, messages: list[dict[str, str]]) -> int:
    body = {"model": MODEL, "messages": messages}
    resp = httpx.post(kvstore.url + "/v1/lookup", json=body, timeout=10)
    resp.raise_for_status()
    matches = {m["instance"]: m["matched_tokens"] for m in resp.json()["matches"]}
    return int(matches.get(instance, 0))


class LossyLink:
    """Forwards an engine's event frames to its own PUB socket, dropping the n-th one."""

    def __init__(self, source: str, drop: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.drop = drop
        self.seen = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            if self.sub.poll(100):
                frames = self.sub.recv_multipart()
                self.seen += 1
                if self.seen != self.drop:
                    self.pub.send_multipart(frames)

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


def test_a_sequence_gap_is_filled_from_vllms_replay_socket(
    pair: list[VllmEngine], tmp_path: Path
) -> None:
    engine = pair[1]
    reset_caches(pair)
    link = LossyLink(engine.kv_events, drop=2)
    try:
        subscribe = f"{engine.url}={link.endpoint},replay={engine.kv_replay}"
        with kvstore_service(tmp_path, subscribe) as kvstore:
            time.sleep(1.0)  # both SUB sockets join before the engine publishes
            talks = [conversation(t) for t in ("glaciers", "volcanoes", "deltas")]
            for n, messages in enumerate(talks, start=1):
                chat(engine.url, messages)
                eventually(lambda n=n: link.seen >= n, 20, 0.2)

            def replayed() -> float:
                text = httpx.get(kvstore.url + "/metrics", timeout=10).text
                return sum(values(text, "switchyard_kvstore_replays_total", outcome="ok"))

            eventually(lambda: replayed() == 1, 20, 0.2)
            assert matched_tokens(kvstore, engine.url, talks[1]) > 0
    finally:
        link.close()


def test_real_events_reach_a_kvstore_service(pair: list[VllmEngine], tmp_path: Path) -> None:
    engine = pair[0]
    reset_caches(pair)
    messages = conversation("tides")
    subscribe = f"{engine.url}={engine.kv_events},replay={engine.kv_replay}"
    with kvstore_service(tmp_path, subscribe) as kvstore:
        time.sleep(1.0)  # the SUB socket joins before the engine publishes
        chat(engine.url, messages)
        cached = chat(engine.url, messages).json()["usage"]["prompt_tokens_details"]
        eventually(lambda: matched_tokens(kvstore, engine.url, messages) > 0, 20, 0.2)
        # The engine recomputes the last prompt token, so a prompt of whole blocks reuses
        # one block less than it stored.
        matched = matched_tokens(kvstore, engine.url, messages)
        assert 0 <= matched - cached["cached_tokens"] <= BLOCK_SIZE
