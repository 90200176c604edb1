"""Each injected fault behaves as named, set by flag or at runtime via POST /admin/faults."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import zmq

from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(60)

CLEAR = {
    "error_rate": 0,
    "latency_rate": 0,
    "hang_rate": 0,
    "slow_stream_ms": 0,
    "drop_after_tokens": 0,
    "drop_rate": 1,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    port = free_port()
    with Server(["mock", "--port", str(port), "--speed", "50"], port) as srv:
        yield srv


@pytest.fixture
def engine(server: Server) -> Iterator[Server]:
    yield server
    assert httpx.post(server.url + "/admin/faults", json=CLEAR).status_code == 200


def set_faults(srv: Server, **faults: object) -> None:
    r = httpx.post(srv.url + "/admin/faults", json=faults)
    assert r.status_code == 200, r.text


def complete(srv: Server, timeout: float = 10, **body: object) -> httpx.Response:
    payload = {"prompt": "fault", "max_tokens": 2, **body}
    return httpx.post(srv.url + "/v1/completions", json=payload, timeout=timeout)


def test_error_fault_by_flag_answers_with_the_chosen_status() -> None:
    port = free_port()
    args = ["mock", "--port", str(port), "--fault-error-rate", "1", "--fault-error-codes", "503"]
    with Server(args, port) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model="mock-model", prompt="x", max_tokens=1)
    assert info.value.status_code == 503
    assert "injected fault" in info.value.message


def test_error_fault_at_runtime_then_cleared(engine: Server) -> None:
    set_faults(engine, error_rate=1.0, error_codes=[429])
    failed = complete(engine)
    set_faults(engine, error_rate=0)
    assert failed.status_code == 429
    assert failed.json()["error"]["code"] == 429
    assert complete(engine).status_code == 200


def test_admin_rejects_unknown_fault_settings(engine: Server) -> None:
    r = httpx.post(engine.url + "/admin/faults", json={"explode": 1})
    assert r.status_code == 400
    assert "explode" in r.json()["error"]["message"]


def test_latency_spike_delays_the_answer(engine: Server) -> None:
    set_faults(engine, latency_rate=1.0, latency_ms=300)
    started = time.monotonic()
    r = complete(engine)
    assert r.status_code == 200
    assert time.monotonic() - started >= 0.3


def test_hang_accepts_and_never_answers(engine: Server) -> None:
    set_faults(engine, hang_rate=1.0)
    with pytest.raises(httpx.ReadTimeout):
        complete(engine, timeout=0.5)
    set_faults(engine, hang_rate=0)
    assert complete(engine).status_code == 200


def test_slow_stream_spaces_out_the_chunks(engine: Server) -> None:
    set_faults(engine, slow_stream_ms=100)
    started = time.monotonic()
    r = complete(engine, max_tokens=4, stream=True)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert time.monotonic() - started >= 0.4


def test_drop_cuts_the_connection_mid_stream(engine: Server) -> None:
    set_faults(engine, drop_after_tokens=3)
    received: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream(
            "POST",
            engine.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 50, "stream": True},
        ) as r:
            for line in r.iter_lines():
                received.append(line)
    data = [line for line in received if line.startswith("data: ")]
    assert 1 <= len(data) < 50
    assert "data: [DONE]" not in data


def test_crash_fault_exits_the_process_after_n_requests() -> None:
    port = free_port()
    srv = Server(["mock", "--port", str(port), "--speed", "50", "--fault-crash-after", "2"], port)
    with srv:
        assert complete(srv).status_code == 200
        assert complete(srv).status_code == 200
        with pytest.raises(httpx.TransportError):
            complete(srv)
        assert srv.proc is not None
        assert srv.proc.wait(timeout=5) != 0


def test_kv_gap_skips_event_sequence_numbers() -> None:
    port, events = free_port(), free_port()
    args = ["mock", "--port", str(port), "--speed", "50", "--kv-events-port", str(events)]
    with Server(args, port) as srv:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 3000)
        sub.connect(f"tcp://127.0.0.1:{events}")
        try:
            seqs: list[int] = []
            attempt = 0
            while not seqs:
                attempt += 1  # fresh prompts: a cached one stores no blocks, sends no event
                complete(srv, prompt=f"warm up {attempt} " * 20)
                try:
                    seqs.append(int.from_bytes(sub.recv_multipart(zmq.NOBLOCK)[1], "big"))
                except zmq.Again:
                    time.sleep(0.05)
            set_faults(srv, kv_gap=5)
            complete(srv, prompt="after the gap " * 20)
            sub.setsockopt(zmq.RCVTIMEO, 500)
            while True:
                try:
                    seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                except zmq.Again:
                    break
        finally:
            sub.close(linger=0)
    steps = [b - a for a, b in zip(seqs, seqs[1:], strict=False)]
    assert sorted(set(steps)) == [1, 6] or steps == [6]
    assert steps.count(6) == 1


def test_kv_drop_loses_batches_on_the_wire_that_replay_recovers() -> None:
    port, events, replay = free_port(), free_port(), free_port()
    args = ["mock", "--port", str(port), "--speed", "50", "--kv-events-port", str(events)]
    with Server([*args, "--kv-events-replay-port", str(replay)], port) as srv:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 500)
        sub.connect(f"tcp://127.0.0.1:{events}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 3000)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        try:
            seen: list[int] = []
            attempt = 0
            while not seen:
                attempt += 1  # fresh prompts: a cached one stores no blocks, sends no event
                complete(srv, prompt=f"warm up {attempt} " * 20)
                try:
                    seen.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                except zmq.Again:
                    continue
            set_faults(srv, kv_drop=1)
            complete(srv, prompt="dropped batch " * 20)
            complete(srv, prompt="delivered batch " * 20)
            while True:
                try:
                    seen.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                except zmq.Again:
                    break
            missing = sorted(set(range(seen[0], seen[-1] + 1)) - set(seen))
            dealer.send_multipart([b"", missing[0].to_bytes(8, "big")])
            replayed: list[int] = []
            while True:
                *_, seq, _payload = dealer.recv_multipart()  # [b"", topic, seq, payload]
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                replayed.append(int.from_bytes(seq, "big"))
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)
    assert len(missing) == 1
    assert missing[0] in replayed
