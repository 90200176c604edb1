"""switchyard.core.packing: msgpack bytes from a packer kept per thread."""

from __future__ import annotations

import msgpack
import pytest

from switchyard.core.packing import packb


def test_packb_gives_what_msgpack_packb_gives() -> None:
    obj = ["origin", b"topic", b"\x00" * 300, {"k": [1, 2.5, None]}, ("tuple",)]
    assert packb(obj) == msgpack.packb(obj)


def test_a_later_call_leaves_earlier_bytes_as_they_were() -> None:
    first = packb([1, b"a" * 1000])
    packb([2, b"b" * 5000])
    assert msgpack.unpackb(first) == [1, b"a" * 1000]


def test_an_unpackable_object_leaves_nothing_behind_for_the_next_call() -> None:
    with pytest.raises(TypeError):
        packb([1, object()])
    assert msgpack.unpackb(packb([3])) == [3]
