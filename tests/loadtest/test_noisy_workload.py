"""The noisy workload: two tenants at the asked rates and keys, fixed by the seed."""

from __future__ import annotations

import asyncio

import pytest

from bench.fairness import Cell, Run, prefill_capacity
from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.workload import Request, Workload
from switchyard.loadtest.workloads import build_workload

# Short prompts keep the generator cheap; the shapes under test do not depend on length.
SMALL = {
    "rate": 10.0,
    "duration_s": 20.0,
    "flood_prompt_tokens": (200, 300),
    "quiet_prompt_tokens": (10, 20),
}


REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\nx-switchyard-reason: queue_full\r\n"
    b'content-length: 16\r\nconnection: close\r\n\r\n{"error":"busy"}'
)


def _of(w: Workload, tenant: str) -> list[Request]:
    return [r for r in w.requests if r.tenant == tenant]


def _tokens(r: Request) -> int:
    return len(r.messages[-1]["content"].split())  # one word is one token (text.WordBank)


def test_each_tenant_arrives_at_its_share_of_the_rate_within_the_duration() -> None:
    w = build_workload("noisy", 1, flood_x=3.0, quiet_share=0.2, **SMALL)
    a, b = _of(w, "A"), _of(w, "B")
    assert 540 <= len(a) <= 660  # 3 x 10 per second for 20 s: 600, within 2.5 sd
    assert 24 <= len(b) <= 56  # 0.2 x 10 per second for 20 s: 40, within 2.5 sd
    assert len(w.requests) == len(a) + len(b)
    for stream in (a, b):
        assert stream[0].arrival_s == 0.0
        assert 18.0 < stream[-1].arrival_s < 20.0  # both span the same window
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times)
    assert [r.index for r in w.requests] == list(range(len(w.requests)))


def test_a_long_quiet_stream_settles_on_its_rate() -> None:
    w = build_workload("noisy", 4, **{**SMALL, "duration_s": 500.0, "flood_x": 0.0})
    assert 0.9 * 1000 <= len(w.requests) <= 1.1 * 1000  # 2 per second; 1 sd is 3 %


def test_every_request_carries_its_tenants_key_and_prompt_size() -> None:
    w = build_workload("noisy", 2, flood_key="ka", quiet_key="kb", **SMALL)
    assert {r.api_key for r in _of(w, "A")} == {"ka"}
    assert {r.api_key for r in _of(w, "B")} == {"kb"}
    assert all(200 <= _tokens(r) <= 300 for r in _of(w, "A"))
    assert all(10 <= _tokens(r) <= 20 for r in _of(w, "B"))
    assert all(r.max_tokens == 16 for r in w.requests)
    assert len({r.session for r in w.requests}) == len(w.requests)


def test_same_seed_gives_identical_requests_and_another_seed_differs() -> None:
    first = build_workload("noisy", 5, **SMALL)
    assert build_workload("noisy", 5, **SMALL).requests == first.requests
    other = build_workload("noisy", 6, **SMALL)
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in first.requests]


def test_the_quiet_tenant_sends_the_same_requests_with_or_without_the_flood() -> None:
    flooded = build_workload("noisy", 3, flood_x=4.0, **SMALL)
    solo = build_workload("noisy", 3, flood_x=0.0, **SMALL)
    assert {r.tenant for r in solo.requests} == {"B"}
    same = [(r.arrival_s, r.messages, r.api_key) for r in _of(solo, "B")]
    assert [(r.arrival_s, r.messages, r.api_key) for r in _of(flooded, "B")] == same


@pytest.mark.parametrize(
    "bad",
    [
        {"flood_key": "k", "quiet_key": "k"},
        {"flood_tenant": "T", "quiet_tenant": "T"},
        {"flood_x": 0.0, "quiet_share": 0.0},
        {"flood_x": -1.0},
    ],
)
def test_tenants_that_cannot_be_told_apart_or_no_traffic_are_refused(
    bad: dict[str, object],
) -> None:
    with pytest.raises(ValueError):
        build_workload("noisy", 0, **{**SMALL, **bad})


def test_replay_sends_each_key_and_records_tenant_and_refusal_headers() -> None:
    """A stub that refuses everything (429, as a router over its queue cap would) sees each
    request's bearer key; the results carry the tenant and the refusal's headers."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
        await reader.readexactly(length)
        seen.extend(
            h.split(":", 1)[1].strip().encode()
            for h in lines
            if h.lower().startswith("authorization")
        )
        writer.write(REFUSAL)
        await writer.drain()
        writer.close()

    async def run() -> list[object]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        w = build_workload("noisy", 0, rate=10.0, duration_s=0.3, flood_x=1.0, quiet_share=1.0)
        async with server:
            results = await replay(f"http://127.0.0.1:{port}", w, "m", timeout_s=10.0)
        return [w, results]

    w, results = asyncio.run(run())
    assert isinstance(w, Workload) and isinstance(results, list)
    assert sorted(seen) == sorted(f"Bearer {r.api_key}".encode() for r in w.requests)
    assert [r.tenant for r in results] == [r.tenant for r in w.requests]
    assert {r.tenant for r in results} == {"A", "B"}
    for r in results:
        assert (r.ok, r.status, r.retry_after, r.reason) == (False, 429, "2", "queue_full")
        assert r.e2e_s is not None and r.e2e_s > 0


def _result(tenant: str, status: int, **kw: object) -> Result:
    r = Result(0, 0.0, tenant, ok=status == 200, status=status)
    for name, value in kw.items():
        setattr(r, name, value)
    return r


def test_fairness_bench_counts_a_request_neither_answered_nor_refused_as_lost() -> None:
    results = [
        _result("A", 200, prompt_tokens=1000, output_tokens=10, done_s=2.0),
        _result("A", 429, retry_after="1", reason="queue_full", e2e_s=0.004),
        _result("A", 0, error="TimeoutError: "),
        _result("B", 503, reason="shutting_down", e2e_s=0.002),
        _result("B", 200, ttft_s=0.05, done_s=0.5),
    ]
    run = Run(results, capacity=1000.0, flood_tenant="A", quiet_tenant="B")
    assert len(run.refused) == 2
    assert run.lost == 1
    assert run.quiet_ttft_ms(90) == pytest.approx(50.0)
    assert run.flood_share == pytest.approx(1010 / 2.0 / 1000.0)  # A's tokens over its span

    # B's answer (no tokens counted) takes nothing off the 800 tokens a second the fleet
    # serves saturated: A's 505 a second are that share of it
    assert run.served_per_s("B") == 0.0
    cell = Cell()
    cell.add(Run([], 1000.0, "A", "B"), run, saturated_per_s=800.0)
    assert cell.remaining == [pytest.approx(505 / 800.0)]
    assert (cell.refused_a, cell.refused_b, cell.lost) == ([1], [1], 1)
    assert cell.no_retry_after == 1  # the 503 came without one
    assert cell.refusal_max_ms == [pytest.approx(4.0)]
    assert cell.reasons == {"429 queue_full": 1, "503 shutting_down": 1}


def test_fairness_bench_capacity_scales_with_engines_and_speed() -> None:
    one = prefill_capacity(1, 1.0, 8192)
    assert 40_000 < one < 70_000  # an 8B model's prefill on one H100, tokens a second
    assert prefill_capacity(4, 0.25, 8192) == pytest.approx(one)
    # smaller steps pay the fixed per-step cost more often
    assert prefill_capacity(1, 1.0, 2048) < one
