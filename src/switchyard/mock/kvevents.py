"""KV events on vLLM's wire: ZMQ PUB frames ``[topic, seq (8-byte big-endian), msgpack]``.

Follows ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``): the batch is the
positional array ``[ts, events, data_parallel_rank]``; events are tagged by class name,
either as positional arrays (``encoding="array"``, older vLLM and SGLang) or as maps with
a ``"type"`` key (``encoding="map"``, vLLM #42892 and later, 0.32 included). A ROUTER socket
answers replay requests (``[identity, b"", start_seq]``) with every buffered
``[topic, seq, payload]`` from ``start_seq`` on, then the end marker
``[b"", -1 as signed 8 bytes, b""]`` (vLLM 0.32's ``_service_replay``). Endpoint ports are
offset by the DP rank, as vLLM does.

Payloads are encoded by the caller (microseconds) and handed to a background thread over
an inproc socket without blocking: if that thread falls ``max_queue`` batches behind, new
batches are dropped and counted (``dropped``) rather than stalling the engine loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from typing import Any, Literal

import msgpack
import zmq

from switchyard.mock.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger(__name__)

Encoding = Literal["array", "map"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_BATCH = b"B"
_GAP = b"G"
_DROP = b"D"
_STOP = b"S"


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's per-rank endpoint: tcp port + rank, inproc name + ``_dp<rank>``."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + dp_rank}" if port.isdigit() else endpoint
    if "tcp" in endpoint:
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def bind_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[1].isdigit()


def _event_array(ev: object) -> list[Any]:
    if isinstance(ev, BlockStored):
        return [
            "BlockStored",
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
        ]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {ev!r}")


def _event_map(ev: object) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
            "extra_keys": ev.extra_keys or [None] * len(ev.block_hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": ev.block_hashes,
            "medium": ev.medium,
            "group_idx": 0,
        }
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def encode_batch(batch: KVEventBatch, encoding: Encoding = "array") -> bytes:
    """The msgpack payload frame for one batch, byte-compatible with msgspec's output."""
    conv = _event_map if encoding == "map" else _event_array
    body: list[Any] = [batch.ts, [conv(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


# Inproc inbox names, unique for the life of the process.
_INBOXES = itertools.count()


class KVEventPublisher:
    """One rank's event stream. ``publish`` is safe to call from the engine's loop."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "map",
        dp_rank: int = 0,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        bind: bool = True,
        max_queue: int = 100_000,
    ) -> None:
        # vLLM binds wildcard/ipc endpoints and connects otherwise; the mock is always the
        # stable side, so it binds unless told not to (and can thus bind 127.0.0.1 only).
        self.endpoint = offset_endpoint_port(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, dp_rank)
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.dp_rank = dp_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # A counter, not id(self): an id comes back for a new publisher while the inbox of
        # a collected one may still be bound ("Address already in use").
        self._inbox_addr = f"inproc://kvevents-{next(_INBOXES)}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        inbox = self._ctx.socket(zmq.PULL)
        inbox.set_hwm(max_queue)
        inbox.bind(self._inbox_addr)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        assert self.endpoint is not None
        if bind:
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        last = self._pub.getsockopt(zmq.LAST_ENDPOINT)
        self._last_endpoint = last.decode() if isinstance(last, bytes) else str(last)
        self._replay: zmq.Socket[bytes] | None = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            last = self._replay.getsockopt(zmq.LAST_ENDPOINT)
            self._replay_last = last.decode() if isinstance(last, bytes) else str(last)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.set_hwm(max_queue)
        self._outbox.connect(self._inbox_addr)
        self.dropped = 0  # batches refused because the publisher thread fell behind
        self._thread = threading.Thread(
            target=self._serve, args=(inbox,), daemon=True, name=f"kv-events-{dp_rank}"
        )
        self._thread.start()

    @property
    def pub_port(self) -> int | None:
        """The bound TCP port (useful with ``tcp://127.0.0.1:*``-style dynamic binding)."""
        text = self._last_endpoint
        return int(text.rsplit(":", 1)[1]) if bind_tcp(text) else None

    @property
    def replay_port(self) -> int | None:
        if self._replay is None or not bind_tcp(self._replay_last):
            return None
        return int(self._replay_last.rsplit(":", 1)[1])

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.dp_rank
        self._send(_BATCH, encode_batch(batch, self.encoding))

    def inject_gap(self, n: int = 1) -> None:
        """Skip ``n`` sequence numbers (a subscriber sees a hole nothing can fill)."""
        self._send(_GAP, n.to_bytes(8, "big"))

    def drop_next(self, n: int = 1) -> None:
        """Keep the next ``n`` batches off the PUB socket but in the replay buffer (lost
        messages a subscriber can recover by replay)."""
        self._send(_DROP, n.to_bytes(8, "big"))

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._outbox.send_multipart((_STOP, b""))  # blocking: the stop must get through
        self._thread.join(timeout=5)
        with self._lock:
            self._closed = True
            self._outbox.close(linger=0)

    def _send(self, kind: bytes, data: bytes) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("publisher is closed")
            try:
                self._outbox.send_multipart((kind, data), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.dropped += 1

    # ------------------------------------------------------------------ thread

    def _serve(self, inbox: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        dropping = 0
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
                if not ready.get(inbox):
                    continue
                kind, data = inbox.recv_multipart()
                if kind == _STOP:
                    return
                if kind == _GAP:
                    for _ in range(int.from_bytes(data, "big")):
                        next(self._seq)
                    continue
                if kind == _DROP:
                    dropping += int.from_bytes(data, "big")
                    continue
                seq = next(self._seq)
                self._buffer.append((seq, data))
                if dropping:
                    dropping -= 1
                    continue
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), data))
        except zmq.ZMQError:
            log.exception("KV event publisher stopped")
        finally:
            inbox.close(linger=0)
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request: %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
