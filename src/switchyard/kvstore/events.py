"""Decoding of engine KV events (vLLM and SGLang share the envelope).

Wire: ZMQ multipart ``[topic, seq (8-byte big-endian), msgpack(EventBatch)]``.
``EventBatch`` is ``(ts, events, data_parallel_rank?)``; older vLLM and SGLang encode the
batch and every event as positional arrays tagged by class name in slot 0, newer vLLM
as maps with a ``"type"`` key. Block hashes may be uint64, int64 or bytes; they are kept
as given (only used as dictionary keys for engine-hash -> our-key mapping).
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

EngineHash = int | bytes


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch in any known encoding."""


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent] = []
    data_parallel_rank: int | None = None


# Typed decoding of the map encoding (vLLM 0.32): one C pass, a fraction of the cost of
# unpacking and then walking the objects. Other shapes (array-encoded events, unknown
# event types) fail its validation and take the general path.
_MAP_BATCH = msgspec.msgpack.Decoder(EventBatch)

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, int | bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        # JSON pushes cannot carry bytes; a hex string stands for the raw hash bytes.
        try:
            return bytes.fromhex(value)
        except ValueError as exc:
            raise EventDecodeError(f"block hash {value!r} is neither int nor hex") from exc
    raise EventDecodeError(f"block hash of type {type(value).__name__}")


def _hashes(values: Any) -> list[EngineHash]:
    if not isinstance(values, list | tuple):
        raise EventDecodeError("block_hashes must be a list")
    return [v if type(v) is int else _hash(v) for v in values]


def decode_event(raw: Any) -> KVEvent | None:
    """One event from either encoding; unknown event types give ``None`` (skipped).

    ``BlockRemoved`` is tested first: vLLM publishes one per evicted block, so it is most
    of the events of a busy engine."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockRemoved":
            if "block_hashes" not in raw:
                raise EventDecodeError("BlockRemoved without block_hashes")
            return BlockRemoved(_hashes(raw["block_hashes"]), raw.get("medium"))
        fields = raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == "BlockRemoved":
            if len(raw) < 2:
                raise EventDecodeError("BlockRemoved without block_hashes")
            return BlockRemoved(_hashes(raw[1]), raw[2] if len(raw) > 2 else None)
        fields = dict(zip(_STORED_FIELDS if kind == "BlockStored" else (), raw[1:], strict=False))
    else:
        raise EventDecodeError(f"event is neither map nor tagged array: {raw!r:.80}")
    if kind == "BlockStored":
        try:
            parent = fields.get("parent_block_hash")
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"]),
                parent_block_hash=None if parent is None else _hash(parent),
                token_ids=list(fields["token_ids"]),
                block_size=int(fields["block_size"]),
                lora_id=fields.get("lora_id"),
                medium=fields.get("medium"),
                lora_name=fields.get("lora_name"),
                extra_keys=fields.get("extra_keys"),
            )
        except KeyError as exc:
            raise EventDecodeError(f"BlockStored without {exc}") from exc
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch_obj(obj: Any) -> EventBatch:
    """An ``EventBatch`` from an already-unpacked msgpack/JSON object (array or map)."""
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts", 0.0), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise EventDecodeError(f"not an event batch: {obj!r:.80}")
    if not isinstance(events, list | tuple):
        raise EventDecodeError("event batch without an events list")
    decoded = [e for e in map(decode_event, events) if e is not None]
    return EventBatch(float(ts or 0.0), decoded, None if rank is None else int(rank))


def decode_batch(payload: bytes) -> EventBatch:
    """An ``EventBatch`` from its msgpack bytes."""
    try:
        return _MAP_BATCH.decode(payload)
    except msgspec.ValidationError:
        pass  # not the typed map encoding: decoded below, tolerating what it allows
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"bad msgpack: {exc}") from exc
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise EventDecodeError(f"bad msgpack: {exc}") from exc
    return decode_batch_obj(obj)


def decode_seq(frame: bytes) -> int:
    """The publisher's sequence number (8-byte big-endian; -1 ends a replay)."""
    return int.from_bytes(frame, "big", signed=True)
