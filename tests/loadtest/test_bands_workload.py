"""The bands workload: three priority bands of one tenant at the asked rates, each with its
own ``x-priority``, fixed by the seed; the replay sends each request's headers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchyard.loadtest.client import replay
from switchyard.loadtest.workload import Request, Workload
from switchyard.loadtest.workloads.bands import (
    BATCH,
    INTERACTIVE,
    SHEDDABLE,
    BandsParams,
    bands,
)

# Short prompts keep the generator cheap; the shapes under test do not depend on length.
SMALL: dict[str, Any] = {
    "rate": 10.0,
    "duration_s": 20.0,
    "batch_prompt_tokens": (200, 300),
    "short_prompt_tokens": (10, 20),
}


def build(seed: int, **overrides: Any) -> Workload:
    return bands(seed, BandsParams(**{**SMALL, **overrides}))


def _of(w: Workload, band: str) -> list[Request]:
    return [r for r in w.requests if r.tenant == band]


def _tokens(r: Request) -> int:
    return len(r.messages[-1]["content"].split())  # one word is one token (text.WordBank)


def test_each_band_arrives_at_its_share_of_the_rate_within_the_duration() -> None:
    w = build(1, batch_x=3.0, interactive_share=0.2, sheddable_share=0.5)
    batch, interactive, sheddable = _of(w, BATCH), _of(w, INTERACTIVE), _of(w, SHEDDABLE)
    assert 540 <= len(batch) <= 660  # 3 x 10 per second for 20 s: 600, within 2.5 sd
    assert 24 <= len(interactive) <= 56  # 0.2 x 10 per second for 20 s: 40, within 2.5 sd
    assert 75 <= len(sheddable) <= 125  # 0.5 x 10 per second for 20 s: 100, within 2.5 sd
    assert len(w.requests) == len(batch) + len(interactive) + len(sheddable)
    for stream in (batch, interactive, sheddable):
        assert stream[0].arrival_s == 0.0
        assert 17.0 < stream[-1].arrival_s < 20.0  # every band spans the same window
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times)
    assert [r.index for r in w.requests] == list(range(len(w.requests)))


def test_each_band_sends_its_priority_and_prompt_size_with_no_key() -> None:
    w = build(2)
    assert {r.headers for r in _of(w, BATCH)} == {()}, "the batch band is the default band"
    assert {r.headers for r in _of(w, INTERACTIVE)} == {(("x-priority", "high"),)}
    assert {r.headers for r in _of(w, SHEDDABLE)} == {(("x-priority", "low"),)}
    assert {r.api_key for r in w.requests} == {""}, "one tenant: priority alone sets them apart"
    assert all(200 <= _tokens(r) <= 300 for r in _of(w, BATCH))
    assert all(10 <= _tokens(r) <= 20 for r in [*_of(w, INTERACTIVE), *_of(w, SHEDDABLE)])
    assert all(r.max_tokens == 16 for r in w.requests)
    assert len({r.session for r in w.requests}) == len(w.requests)


def test_same_seed_gives_identical_requests_and_another_seed_differs() -> None:
    first = build(5)
    assert build(5).requests == first.requests
    other = build(6)
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in first.requests]


def test_the_interactive_band_sends_the_same_requests_with_or_without_the_others() -> None:
    flooded = build(3, batch_x=4.0, sheddable_share=1.0)
    solo = build(3, batch_x=0.0, sheddable_share=0.0)
    assert {r.tenant for r in solo.requests} == {INTERACTIVE}
    same = [(r.arrival_s, r.messages) for r in _of(solo, INTERACTIVE)]
    assert [(r.arrival_s, r.messages) for r in _of(flooded, INTERACTIVE)] == same


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_x": 0.0, "interactive_share": 0.0, "sheddable_share": 0.0},
        {"batch_x": -1.0},
        {"sheddable_share": -0.1},
    ],
)
def test_negative_rates_or_no_traffic_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        build(0, **bad)


REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\nx-switchyard-reason: shed\r\n"
    b'content-length: 16\r\nconnection: close\r\n\r\n{"error":"busy"}'
)


def test_replay_sends_each_requests_own_headers() -> None:
    """A stub that refuses everything sees each request's ``x-priority`` as the band set it,
    and none on the batch band's."""
    seen: list[str | None] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
        await reader.readexactly(length)
        named = [h.split(":", 1)[1].strip() for h in lines if h.lower().startswith("x-priority")]
        seen.append(named[0] if named else None)
        writer.write(REFUSAL)
        await writer.drain()
        writer.close()

    w = build(0, rate=10.0, duration_s=0.5, batch_x=1.0, interactive_share=1.0,
              sheddable_share=1.0)  # fmt: skip

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await replay(f"http://127.0.0.1:{port}", w, "m", timeout_s=10.0)

    asyncio.run(run())
    expected = {BATCH: None, INTERACTIVE: "high", SHEDDABLE: "low"}
    assert sorted(seen, key=str) == sorted((expected[r.tenant] for r in w.requests), key=str)
    assert {INTERACTIVE, SHEDDABLE, BATCH} <= {r.tenant for r in w.requests}
