"""msgpack encoding with one packer per thread, reused.

``msgpack.packb`` makes a ``Packer`` for each call, and each ``Packer`` allocates a
256 KiB buffer, which glibc serves with an ``mmap`` and frees with a ``munmap`` every
time, and a router with several processes packs several messages a request: the sibling
bus's batches, shared KV operations and placements. A
packer kept per thread allocates its buffer once (``pack`` resets it, also on an error).
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

_local = threading.local()


def packb(obj: Any) -> bytes:
    """``obj`` as msgpack bytes (``msgpack.packb``'s defaults: bin type for bytes)."""
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer()
    data: bytes = packer.pack(obj)
    return data
