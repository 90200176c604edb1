"""Data parallel: one URL honouring X-data-parallel-rank, one port per rank, events per rank."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq

from tests.support import Server, free_port, free_port_block, metric

pytestmark = pytest.mark.timeout(60)


def gen_tokens(text: str, rank: int) -> float:
    return metric(text, "vllm:generation_tokens_total", engine=str(rank))


@pytest.fixture(scope="module")
def dp_engine() -> Iterator[Server]:
    port = free_port()
    with Server(["mock", "--port", str(port), "--dp-size", "2", "--speed", "5"], port) as srv:
        yield srv


def test_dp_header_routes_to_that_rank(dp_engine: Server) -> None:
    before = httpx.get(dp_engine.url + "/metrics").text
    r = httpx.post(
        dp_engine.url + "/v1/completions",
        json={"prompt": "to rank one", "max_tokens": 7},
        headers={"X-data-parallel-rank": "1"},
    )
    after = httpx.get(dp_engine.url + "/metrics").text
    assert r.headers["x-data-parallel-rank"] == "1"
    assert gen_tokens(after, 1) - gen_tokens(before, 1) == 7
    assert gen_tokens(after, 0) == gen_tokens(before, 0)


def test_without_header_a_request_goes_to_the_least_loaded_rank(dp_engine: Server) -> None:
    with httpx.stream(
        "POST",
        dp_engine.url + "/v1/completions",
        json={"prompt": "keeps a rank busy", "max_tokens": 2000, "stream": True},
    ) as busy:
        lines = busy.iter_lines()
        next(lines)
        second = httpx.post(
            dp_engine.url + "/v1/completions", json={"prompt": "spread", "max_tokens": 2}
        )
        busy_rank = busy.headers["x-data-parallel-rank"]
    assert {busy_rank, second.headers["x-data-parallel-rank"]} == {"0", "1"}


def test_unknown_rank_is_a_400(dp_engine: Server) -> None:
    r = httpx.post(
        dp_engine.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-data-parallel-rank": "5"},
    )
    assert r.status_code == 400


def test_dp_external_serves_one_port_per_rank() -> None:
    port = free_port()
    args = ["mock", "--port", str(port), "--dp-size", "2", "--dp-external", "--speed", "50"]
    with Server(args, port):
        r = httpx.post(
            f"http://127.0.0.1:{port + 1}/v1/completions", json={"prompt": "x", "max_tokens": 2}
        )
        text = httpx.get(f"http://127.0.0.1:{port + 1}/metrics").text
    assert r.headers["x-data-parallel-rank"] == "1"
    assert gen_tokens(text, 1) == 2
    assert 'engine="0"' not in text


def test_kv_events_of_a_rank_carry_that_rank_on_port_plus_rank() -> None:
    port, events = free_port(), free_port_block(2)  # rank r publishes on events + r
    args = ["mock", "--port", str(port), "--dp-size", "2", "--speed", "50"]
    with Server([*args, "--kv-events-port", str(events)], port) as srv:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(f"tcp://127.0.0.1:{events + 1}")
        try:
            frames: list[bytes] = []
            for attempt in range(50):
                # A fresh prompt each time: a cached one stores no blocks, so sends no event.
                httpx.post(
                    srv.url + "/v1/completions",
                    json={"prompt": f"block {attempt} " * 40, "max_tokens": 2},
                    headers={"X-data-parallel-rank": "1"},
                )
                try:
                    frames = sub.recv_multipart(flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    continue
            if not frames:
                frames = sub.recv_multipart()
        finally:
            sub.close(linger=0)
    topic, seq, payload = frames
    batch = msgpack.unpackb(payload, raw=False)
    assert len(seq) == 8
    assert batch[2] == 1
    assert batch[1][0]["type"] == "BlockStored"
