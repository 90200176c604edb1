"""VirtualFleet's decode jump-ahead is exact: the same tokens, times, KV events and stats as
stepping every token, with arrivals, cancels and stats reads landing mid-run."""

from __future__ import annotations

import random
from typing import Any

import pytest

from switchyard.mock.engine import virtual
from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.events import KVEventBatch
from switchyard.mock.engine.virtual import VirtualFleet, plain_decode_steps

pytestmark = pytest.mark.timeout(60)


def _workload(seed: int) -> list[tuple[float, EngineRequest, float | None]]:
    """Requests sharing a few prefixes, arriving while others decode; some are cancelled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(48)] for _ in range(4)]
    out: list[tuple[float, EngineRequest, float | None]] = []
    t = 0.0
    for i in range(60):
        t += rng.expovariate(40.0)
        prompt = rng.choice(prefixes)[: rng.randrange(1, 48)] + [
            rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 60))
        ]
        request = EngineRequest(
            f"r{i}", prompt, rng.randrange(1, 120), output_token_ids=[7, 8, 9][: 1 + i % 3]
        )
        cancel = t + rng.uniform(0.0, 0.5) if i % 7 == 3 else None
        out.append((t, request, cancel))
    return out


def _run(jump_ahead: bool, seed: int, reads_state: bool) -> dict[str, Any]:
    config = EngineConfig(num_gpu_blocks=40, max_num_seqs=6, block_size=16)
    events: list[tuple[int, float, str]] = []
    seen_loads: list[tuple[float, int]] = []

    def sink(index: int) -> Any:
        def publish(batch: KVEventBatch) -> None:
            events.append((index, batch.ts, repr(batch.events)))

        return publish

    def route(fleet: VirtualFleet, now: float, request: EngineRequest) -> int:
        if not reads_state:
            return int(request.request_id[1:]) % 3
        # Reads engine state mid-run, so a jump must be settled before it answers.
        loads = [fleet.stats(i).generation_tokens_total for i in range(3)]
        seen_loads.append((now, sum(loads)))
        return loads.index(min(loads))

    fleet = VirtualFleet([config] * 3, route, [sink(i) for i in range(3)], jump_ahead=jump_ahead)
    for t, request, cancel in _workload(seed):
        fleet.submit(t, None, request)
        if cancel is not None:
            fleet.cancel(cancel, request.request_id)
    fleet.run()
    results = {
        rid: (
            r.engine_index,
            r.first_token_time,
            r.finish_time,
            r.token_times,
            r.num_cached_tokens,
            r.output_tokens,
            r.finish_reason,
        )
        for rid, r in fleet.results.items()
    }
    return {
        "results": results,
        "events": events,
        "loads": seen_loads,
        "stats": [fleet.stats(i) for i in range(3)],
        "now": fleet.now,
    }


@pytest.mark.parametrize("reads_state", [False, True], ids=["blind_router", "router_reads_stats"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jump_ahead_matches_stepping_every_token(
    seed: int, reads_state: bool, monkeypatch: Any
) -> None:
    stepped = _run(False, seed, reads_state)
    landed: list[int] = []
    real_advance = virtual.advance_decode

    def counting(core: Any, seqs: Any, steps: int) -> None:
        landed.append(steps)
        real_advance(core, seqs, steps)

    monkeypatch.setattr(virtual, "advance_decode", counting)
    jumped = _run(True, seed, reads_state)
    assert sum(landed) > 0, "the workload never decoded alone: the test proves nothing"
    assert jumped["results"] == stepped["results"]
    assert jumped["events"] == stepped["events"]
    assert jumped["loads"] == stepped["loads"]
    assert jumped["stats"] == stepped["stats"]
    assert jumped["now"] == stepped["now"]


def test_a_step_that_completes_a_block_is_not_plain() -> None:
    from switchyard.mock.engine.core import EngineCore

    core = EngineCore(EngineConfig(num_gpu_blocks=64, block_size=16))
    core.add_request(EngineRequest("a", list(range(1, 11)), 100))
    core.step(0.0)  # prefill: 10 prompt tokens, the first output token
    # Computed 10 of 11 tokens: tokens 11..15 decode inside block 0, token 16 fills it.
    assert plain_decode_steps(core) == 5


def test_the_step_that_ends_a_request_is_not_plain() -> None:
    from switchyard.mock.engine.core import EngineCore

    core = EngineCore(EngineConfig(num_gpu_blocks=64, block_size=16))
    core.add_request(EngineRequest("a", list(range(1, 11)), 3))
    core.step(0.0)
    assert plain_decode_steps(core) == 1  # the second token; the third ends it


def test_nothing_is_plain_while_a_request_waits() -> None:
    from switchyard.mock.engine.core import EngineCore

    core = EngineCore(EngineConfig(num_gpu_blocks=64, block_size=16))
    core.add_request(EngineRequest("a", list(range(1, 11)), 100))
    core.step(0.0)
    core.add_request(EngineRequest("b", list(range(50, 60)), 100))
    assert plain_decode_steps(core) == 0
