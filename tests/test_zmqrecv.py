"""``switchyard.net.zmqrecv.messages``: a burst is read whole and in order, then it waits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq

from switchyard.net.zmqrecv import BURST, ZmqContext, messages

pytestmark = pytest.mark.timeout(30)


async def pair() -> tuple[ZmqContext, zmq.Socket[bytes], zmq.Socket[bytes]]:
    ctx: ZmqContext = zmq.Context()
    pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    return ctx, push, pull


async def take(stream: AsyncIterator[list[bytes]], n: int) -> list[list[bytes]]:
    return [await anext(stream) for _ in range(n)]


async def test_a_burst_longer_than_one_turn_arrives_whole_and_in_order() -> None:
    ctx, push, pull = await pair()
    try:
        sent = [[b"t", str(i).encode()] for i in range(3 * BURST + 5)]
        for frames in sent:
            push.send_multipart(frames)
        async with asyncio.timeout(5):
            got = await take(messages(pull), len(sent))
        assert got == sent
    finally:
        ctx.destroy(linger=0)


async def test_after_a_burst_the_reader_waits_for_the_next_message() -> None:
    ctx, push, pull = await pair()
    try:
        stream = messages(pull)
        push.send_multipart([b"first"])
        async with asyncio.timeout(5):
            assert await anext(stream) == [b"first"]
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        push.send_multipart([b"later"])
        async with asyncio.timeout(5):
            assert await waiting == [b"later"]
    finally:
        ctx.destroy(linger=0)


async def test_a_reader_cancelled_while_waiting_leaves_no_watch_on_the_socket() -> None:
    ctx, push, pull = await pair()
    try:
        waiting = asyncio.ensure_future(anext(messages(pull)))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not asyncio.get_running_loop().remove_reader(pull.FD)
    finally:
        ctx.destroy(linger=0)


async def test_a_message_sent_between_two_reads_wakes_the_reader() -> None:
    ctx, push, pull = await pair()
    try:
        stream = messages(pull)
        for i in range(20):
            push.send_multipart([str(i).encode()])
            async with asyncio.timeout(5):
                assert await anext(stream) == [str(i).encode()]
    finally:
        ctx.destroy(linger=0)
