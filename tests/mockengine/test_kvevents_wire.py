"""The KV-event publisher on real ZMQ sockets (127.0.0.1), held to the hand-built goldens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from switchyard.mock.kvevents import END_SEQ, KVEventPublisher, encode_batch, offset_endpoint_port
from switchyard.mock.settings import MockSettings
from tests.support import free_port

pytestmark = pytest.mark.timeout(30)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kv_events"
GOLDEN = json.loads((FIXTURES / "expected.json").read_text())
TS = 1_700_000_000.5


def golden(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def golden_batch(vh: list[int], tokens: list[int]) -> KVEventBatch:
    return KVEventBatch(
        TS,
        [BlockStored(vh, None, tokens, 16), BlockRemoved([vh[1]]), AllBlocksCleared()],
    )


class Subscriber:
    def __init__(self, port: int, topic: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def recv(self) -> tuple[bytes, int, bytes]:
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload

    def close(self) -> None:
        self.sock.close(linger=0)


def wait_connected(pub: KVEventPublisher, sub: Subscriber) -> int:
    """PUB drops messages until the SUB handshake is done; probe until one arrives."""
    sub.sock.setsockopt(zmq.RCVTIMEO, 50)
    for _ in range(100):
        pub.publish(KVEventBatch(0.0, []))
        try:
            _, seq, _ = sub.recv()
        except zmq.Again:
            continue
        sub.sock.setsockopt(zmq.RCVTIMEO, 5000)
        while True:  # drain other probes that were in flight
            try:
                sub.sock.setsockopt(zmq.RCVTIMEO, 100)
                _, seq, _ = sub.recv()
            except zmq.Again:
                sub.sock.setsockopt(zmq.RCVTIMEO, 5000)
                return seq
    raise AssertionError("subscriber never connected")


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    yield free_port(), free_port()


def open_pair(
    port: int, replay: int | None = None, **kw: object
) -> tuple[KVEventPublisher, Subscriber]:
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{replay}" if replay else None,
        **kw,  # type: ignore[arg-type]
    )
    return pub, Subscriber(port)


@pytest.mark.parametrize(
    ("encoding", "name"), [("array", "vllm_array_batch.bin"), ("map", "vllm_map_batch.bin")]
)
def test_frames_on_the_wire_match_the_vllm_goldens(
    ports: tuple[int, int], encoding: str, name: str
) -> None:
    pub, sub = open_pair(ports[0], topic="kv@engine", encoding=encoding)
    sub.sock.setsockopt(zmq.SUBSCRIBE, b"kv@engine")
    try:
        last = wait_connected(pub, sub)
        pub.publish(golden_batch(GOLDEN["vllm_block_hashes_uint64"], GOLDEN["vllm_token_ids"]))
        topic, seq, payload = sub.recv()
        assert topic == b"kv@engine"
        assert seq == last + 1
        assert msgpack.unpackb(payload) == msgpack.unpackb(golden(name))
        assert payload == golden(name)
    finally:
        sub.close()
        pub.close()


def test_engine_events_through_the_publisher_match_the_sglang_golden(
    ports: tuple[int, int],
) -> None:
    pub, sub = open_pair(ports[0], encoding="array")
    core = EngineCore(EngineConfig(num_gpu_blocks=64, hash_flavor="sglang"), event_sink=pub.publish)
    try:
        wait_connected(pub, sub)
        core.add_request(EngineRequest("g", GOLDEN["sglang_token_ids"] + [1], 1))
        core.step(TS)
        _, _, payload = sub.recv()
        got = msgpack.unpackb(payload)
        want = msgpack.unpackb(golden("sglang_array_batch.bin"))
        assert got[0] == TS and got[2] == 0
        assert got[1] == want[1][:2]  # the two page BlockStored events, chained
    finally:
        sub.close()
        pub.close()


def test_engine_events_through_the_publisher_match_the_vllm_map_golden(
    ports: tuple[int, int],
) -> None:
    pub, sub = open_pair(ports[0], encoding="map")
    core = EngineCore(EngineConfig(num_gpu_blocks=64), event_sink=pub.publish)
    try:
        wait_connected(pub, sub)
        core.add_request(EngineRequest("g", GOLDEN["vllm_token_ids"] + [1], 1))
        core.step(TS)
        _, _, payload = sub.recv()
        assert msgpack.unpackb(payload)[1][0] == msgpack.unpackb(golden("vllm_map_batch.bin"))[1][0]
    finally:
        sub.close()
        pub.close()


def replay_from(port: int, start: int) -> list[tuple[bytes, int, bytes]]:
    """``(topic, seq, payload)`` of each replayed batch, as vLLM 0.32's replay answers."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def test_replay_returns_the_batches_a_subscriber_missed(ports: tuple[int, int]) -> None:
    pub, sub = open_pair(ports[0], ports[1], encoding="array")
    try:
        last = wait_connected(pub, sub)
        pub.drop_next(2)
        for i in range(3):
            pub.publish(KVEventBatch(float(i), [BlockRemoved([i])]))
        _, seq, _ = sub.recv()
        assert seq == last + 3  # the two before it never arrived
        replayed = replay_from(ports[1], last + 1)
        assert [s for _, s, _ in replayed] == [last + 1, last + 2, last + 3]
        assert [msgpack.unpackb(p)[1] for _, _, p in replayed] == [
            [["BlockRemoved", [i], "GPU"]] for i in range(3)
        ]
    finally:
        sub.close()
        pub.close()


def test_replayed_batches_carry_the_topic_frame_as_vllm_sends_them(
    ports: tuple[int, int],
) -> None:
    pub, sub = open_pair(ports[0], ports[1], topic="kv@10.0.0.7@m")
    try:
        last = wait_connected(pub, sub)
        pub.publish(KVEventBatch(1.0, [AllBlocksCleared()]))
        sub.recv()
        assert [t for t, _, _ in replay_from(ports[1], last + 1)] == [b"kv@10.0.0.7@m"]
    finally:
        sub.close()
        pub.close()


def test_a_vllm_mock_encodes_events_as_maps_as_vllm_0_32_does() -> None:
    assert MockSettings.load().kv_events_encoding == "map"


def test_an_sglang_mock_encodes_events_as_arrays() -> None:
    assert MockSettings.load(flavor="sglang").kv_events_encoding == "array"


def test_injected_gap_skips_sequence_numbers(ports: tuple[int, int]) -> None:
    pub, sub = open_pair(ports[0])
    try:
        last = wait_connected(pub, sub)
        pub.inject_gap(5)
        pub.publish(KVEventBatch(1.0, [AllBlocksCleared()]))
        _, seq, _ = sub.recv()
        assert seq == last + 6
    finally:
        sub.close()
        pub.close()


def test_dp_rank_offsets_the_ports_and_tags_the_batch() -> None:
    base = free_port()
    while True:
        try:
            pub = KVEventPublisher(f"tcp://127.0.0.1:{base}", dp_rank=2)
            break
        except zmq.ZMQError:
            base = free_port()
    sub = Subscriber(base + 2)
    try:
        assert pub.pub_port == base + 2
        wait_connected(pub, sub)
        pub.publish(KVEventBatch(3.0, []))
        _, _, payload = sub.recv()
        assert msgpack.unpackb(payload) == [3.0, [], 2]
    finally:
        sub.close()
        pub.close()


def test_endpoint_offset_follows_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"


def test_map_encoding_carries_extra_keys_and_array_encoding_omits_them() -> None:
    stored = BlockStored([1, 2], None, list(range(32)), 16, extra_keys=[("salt",), None])
    batch = KVEventBatch(1.0, [stored], 0)
    assert msgpack.unpackb(encode_batch(batch, "map"))[1][0]["extra_keys"] == [["salt"], None]
    assert len(msgpack.unpackb(encode_batch(batch, "array"))[1][0]) == 7


def test_batch_without_rank_is_a_two_element_array() -> None:
    assert msgpack.unpackb(encode_batch(KVEventBatch(2.0, [AllBlocksCleared()]))) == [
        2.0,
        [["AllBlocksCleared"]],
    ]


def test_digest_hashes_go_on_the_wire_as_msgpack_bin() -> None:
    digest = bytes(range(32))
    payload = encode_batch(KVEventBatch(1.0, [BlockRemoved([digest])], 0))
    assert msgpack.unpackb(payload)[1][0][1] == [digest]
    assert b"\xc4\x20" + digest in payload  # bin 8, length 32
