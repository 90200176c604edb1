"""The engine model's behaviour, driven step by step or on the virtual clock (no sleeping)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from switchyard.mock.engine.virtual import RequestResult, VirtualFleet, simulate

pytestmark = pytest.mark.timeout(30)

GOLDEN = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "kv_events" / "expected.json").read_text()
)


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"num_gpu_blocks": 256, "max_num_seqs": 16}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens, **kw)  # type: ignore[arg-type]


def run_core(core: EngineCore, t: float = 0.0, limit: int = 100_000) -> float:
    """Step until nothing runs or waits (holds are left alone); returns the end time."""
    for _ in range(limit):
        if not core.has_work():
            return t
        if not core.ready(t):
            due = core.next_wakeup(t)
            assert due is not None
            t = max(t, due)
            continue
        t += core.step(t).duration
    raise AssertionError("engine did not drain")


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_repeated_prompt_hits_the_prefix_cache_and_has_a_smaller_ttft() -> None:
    p = prompt(1000)
    first, second = simulate(cfg(), [(0.0, req("a", p)), (1.0, req("b", p))])
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 992  # 62 full blocks; the last partial one recomputed
    assert second.ttft is not None and first.ttft is not None
    assert second.ttft < first.ttft / 2


def test_cache_hit_never_covers_the_whole_prompt() -> None:
    p = prompt(32)  # exactly two blocks
    _, again = simulate(cfg(), [(0.0, req("a", p)), (1.0, req("b", p))])
    assert again.num_cached_tokens == 16


def test_finished_request_blocks_stay_cached_but_not_in_use() -> None:
    core = EngineCore(cfg())
    core.add_request(req("a", prompt(160)))
    run_core(core)
    assert core.stats().kv_cache_usage == 0.0  # vLLM leaves the null block out
    assert len(core.pool.cached) == 10


def test_freed_blocks_without_a_hash_are_reused_before_cached_ones() -> None:
    # vLLM 0.32 prepends a freed partial tail to the free queue and appends cached blocks.
    core = EngineCore(cfg(num_gpu_blocks=9))  # 8 usable blocks of 16
    a = prompt(40, 1)  # 2 cached blocks and a partial tail
    core.add_request(req("a", a, 1))
    t = run_core(core)
    core.add_request(req("b", prompt(56, 5000), 1))  # 3 cached blocks and a tail: 1 left
    t = run_core(core, t)
    core.add_request(req("c", prompt(33, 9000), 1))  # 3 blocks: both tails and the last one
    t = run_core(core, t)
    again = core.add_request(req("a2", a, 1))
    run_core(core, t)
    assert again.num_cached_tokens == 32


def test_eviction_under_small_cache_emits_block_removed_and_loses_the_hit() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(num_gpu_blocks=9), event_sink=batches.append)  # 8 usable blocks
    a = prompt(64, 1)
    core.add_request(req("a1", a, 1))
    t = run_core(core)
    stored_a = [
        h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    core.add_request(req("b", prompt(112, 5000), 1))  # needs 7 blocks: evicts a's blocks
    t = run_core(core, t)
    removed = [
        h for b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert set(stored_a) & set(removed)
    seq = core.add_request(req("a2", a, 1))
    run_core(core, t)
    assert seq.num_cached_tokens < 48


def test_ttft_grows_with_queue_depth() -> None:
    def probe_ttft(depth: int) -> float:
        arrivals = [(0.0, req(f"q{i}", prompt(512, 10_000 * (i + 1)), 8)) for i in range(depth)]
        arrivals.append((0.0, req("probe", prompt(512, 1), 8)))
        ttft = simulate(cfg(max_num_batched_tokens=1024), arrivals)[-1].ttft
        assert ttft is not None
        return ttft

    assert probe_ttft(0) < probe_ttft(4) < probe_ttft(16)


def test_ttft_grows_with_uncached_prompt_tokens() -> None:
    short, long = simulate(
        cfg(), [(0.0, req("s", prompt(100), 2)), (5.0, req("l", prompt(2000, 9), 2))]
    )
    assert short.ttft is not None and long.ttft is not None
    # a + b*tokens: the 1,900 extra uncached tokens cost about 1,900 * 17.25 µs.
    assert long.ttft - short.ttft == pytest.approx(1900 * 17.25e-6, rel=0.1)


def test_step_time_follows_the_linear_model() -> None:
    c = cfg(context_token_us=0.0)
    core = EngineCore(c)
    core.add_request(req("a", prompt(300), 3))
    first = core.step(0.0)
    second = core.step(first.duration)
    assert first.duration == pytest.approx((5753 + 300 * 17.25) * 1e-6)
    assert second.duration == pytest.approx((5753 + 6.0) * 1e-6)


def test_chunked_prefill_splits_a_long_prompt_and_slows_running_decodes() -> None:
    core = EngineCore(cfg(max_num_batched_tokens=512, context_token_us=0.0))
    core.add_request(req("decoder", prompt(16), 50))
    t = 0.0
    for _ in range(3):
        t += core.step(t).duration
    alone = core.step(t)
    core.add_request(req("long", prompt(2000, 7), 2))
    mixed = core.step(t + alone.duration)
    assert mixed.num_scheduled == 2
    assert mixed.prefill_tokens == 511  # the budget minus the decode token
    assert [s.request_id for s in mixed.progressed] == ["decoder"]
    assert mixed.duration > alone.duration * 2


def test_max_num_seqs_bounds_the_batch() -> None:
    core = EngineCore(cfg(max_num_seqs=3))
    for i in range(5):
        core.add_request(req(f"r{i}", prompt(20, 100 * i), 10))
    core.step(0.0)
    assert core.stats().num_running == 3
    assert core.stats().num_waiting == 2


def test_abort_frees_the_slot_and_the_blocks_at_once() -> None:
    core = EngineCore(cfg(max_num_seqs=1))
    core.add_request(req("long", prompt(200), 1000))
    core.add_request(req("next", prompt(200, 5000), 2))
    t = core.step(0.0).duration
    assert core.stats().num_running == 1 and core.stats().num_waiting == 1
    core.abort("long")
    assert core.stats().num_running == 0
    assert core.pool.num_free == 255
    assert [s.request_id for s in core.step(t).progressed] == ["next"]


def test_preemption_when_blocks_run_out_still_completes_everything() -> None:
    c = cfg(num_gpu_blocks=24, max_num_seqs=8)
    arrivals = [(0.0, req(f"r{i}", prompt(40, 1000 * i), 100)) for i in range(6)]
    fleet = VirtualFleet([c])
    for t, r in arrivals:
        fleet.submit(t, 0, r)
    results = fleet.run()
    assert fleet.stats(0).num_preemptions > 0
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(6)]
    assert all(r.output_tokens == 100 and r.finish_reason == "length" for r in results)
    assert fleet.stats(0).generation_tokens_total == 600


def test_request_larger_than_the_cache_is_rejected() -> None:
    core = EngineCore(cfg(num_gpu_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request(req("huge", prompt(100), 10))


def test_prefill_role_holds_blocks_until_released() -> None:
    core = EngineCore(cfg())
    seq = core.add_request(req("p", prompt(160), 1, hold_kv_after_prefill=True))
    run_core(core)
    assert seq.finished and seq.finish_reason == "length"
    assert len(seq.blocks) == 10  # 160 prompt tokens; the one output token is never computed
    assert core.pool.num_free == 255 - 10
    assert core.release_held("p") is True
    assert core.pool.num_free == 255
    assert core.release_held("p") is False


def test_prefill_hold_expires_after_the_timeout() -> None:
    core = EngineCore(cfg(held_kv_timeout_s=2.0))
    core.add_request(req("p", prompt(160), 1, hold_kv_after_prefill=True))
    t = core.step(0.0).duration
    core.expire_held(t + 1.0)
    assert "p" in core.held
    core.expire_held(t + 2.5)
    assert "p" not in core.held and core.pool.num_free == 255


def test_remote_prefilled_tokens_cost_a_transfer_not_a_prefill() -> None:
    c = cfg(kv_transfer_us_per_block=100.0, context_token_us=0.0)
    local, remote = simulate(
        c,
        [
            (0.0, req("local", prompt(1600), 2)),
            (5.0, req("remote", prompt(1600, 99), 2, remote_prefilled_tokens=1599)),
        ],
    )
    assert remote.num_cached_tokens == 1599
    assert remote.ttft is not None and local.ttft is not None
    # 100 blocks pulled at 100 µs each, then one step computing the last prompt token.
    assert remote.ttft == pytest.approx(100 * 100e-6 + (5753 + 17.25) * 1e-6, rel=0.01)
    assert remote.ttft < local.ttft / 2
    assert remote.output_tokens == 2


def test_vllm_flavour_publishes_the_golden_block_hashes() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(), event_sink=batches.append)
    core.add_request(req("g", GOLDEN["vllm_token_ids"] + [7], 1))
    core.step(0.0)
    [stored] = batches[0].events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == GOLDEN["vllm_block_hashes_uint64"]
    assert stored.parent_block_hash is None
    assert stored.token_ids == GOLDEN["vllm_token_ids"]


def test_sglang_flavour_publishes_one_event_per_page_with_int64_hashes() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(hash_flavor="sglang"), event_sink=batches.append)
    core.add_request(req("g", GOLDEN["sglang_token_ids"] + [7], 1))
    core.step(0.0)
    first, second = batches[0].events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    expected = GOLDEN["sglang_block_hashes_int64"]
    assert (first.block_hashes, first.parent_block_hash) == ([expected[0]], None)
    assert (second.block_hashes, second.parent_block_hash) == ([expected[1]], expected[0])


def test_generated_blocks_are_cached_and_hit_by_the_next_turn() -> None:
    core = EngineCore(cfg())
    turn1 = prompt(20)
    first = core.add_request(req("t1", turn1, 30, output_token_ids=[42]))
    t = run_core(core)
    history = first.tokens[:-1]  # what was computed: prompt + 29 outputs (the last is unseen)
    second = core.add_request(req("t2", history + prompt(30, 777), 2))
    run_core(core, t)
    assert second.num_cached_tokens == 48


def test_cache_salt_separates_identical_prompts() -> None:
    p = prompt(100)
    _, salted = simulate(cfg(), [(0.0, req("a", p)), (1.0, req("b", p, cache_salt="tenant-b"))])
    assert salted.num_cached_tokens == 0


def test_prefix_cache_counters_count_prompt_tokens_and_hits() -> None:
    core = EngineCore(cfg())
    core.add_request(req("a", prompt(100), 1))
    t = run_core(core)
    core.add_request(req("b", prompt(100), 1))
    run_core(core, t)
    s = core.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (200, 96)
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.requests_finished) == (200, 2, 2)


def test_router_hook_chooses_the_engine_at_arrival() -> None:
    seen: list[tuple[float, int]] = []

    def least_running(fleet: VirtualFleet, now: float, request: EngineRequest) -> int:
        loads = [fleet.stats(i).num_running + fleet.stats(i).num_waiting for i in range(2)]
        seen.append((now, loads[0] + loads[1]))
        return loads.index(min(loads))

    fleet = VirtualFleet([cfg(), cfg()], router=least_running)
    for i in range(4):
        fleet.submit(0.0, None, req(f"r{i}", prompt(50, 100 * i), 20))
    results = fleet.run()
    assert sorted(r.engine_index for r in results) == [0, 0, 1, 1]
    assert [s[1] for s in seen] == [0, 1, 2, 3]


def test_reset_prefix_cache_clears_hits() -> None:
    core = EngineCore(cfg())
    core.add_request(req("a", prompt(100), 1))
    t = run_core(core)
    assert core.reset_prefix_cache() is True
    again = core.add_request(req("b", prompt(100), 1))
    run_core(core, t)
    assert again.num_cached_tokens == 0


def test_all_blocks_cleared_is_published_with_the_next_step_as_vllm_does() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(), event_sink=batches.append)
    core.add_request(req("a", prompt(100), 1))
    t = run_core(core)
    published = len(batches)
    assert core.reset_prefix_cache() is True
    assert len(batches) == published
    core.add_request(req("b", prompt(100), 1))
    run_core(core, t)
    assert isinstance(batches[published].events[0], AllBlocksCleared)
    assert isinstance(batches[published].events[1], BlockStored)


def test_reset_prefix_cache_is_refused_while_requests_hold_blocks() -> None:
    core = EngineCore(cfg())
    core.add_request(req("a", prompt(100), 50))
    core.step(0.0)
    assert core.reset_prefix_cache() is False


def test_work_blocked_by_held_blocks_waits_for_the_hold_to_expire() -> None:
    c = cfg(num_gpu_blocks=12, held_kv_timeout_s=3.0)  # 11 usable blocks
    held, blocked = simulate(
        c,
        [
            (0.0, req("p", prompt(160), 1, hold_kv_after_prefill=True)),  # holds 10 blocks
            (0.1, req("q", prompt(64, 5000), 2)),  # needs 5
        ],
    )
    assert held.finish_time is not None and blocked.first_token_time is not None
    assert blocked.first_token_time >= held.finish_time + 3.0
    assert blocked.output_tokens == 2


def test_salted_blocks_carry_their_extra_keys_in_block_stored() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(), event_sink=batches.append)
    core.add_request(req("s", prompt(40), 1, cache_salt="tenant-a", lora_name="adapter"))
    core.step(0.0)
    [stored] = batches[0].events
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == [("adapter", "tenant-a"), ("adapter",)]
    assert stored.lora_name == "adapter"


def test_virtual_fleet_chains_a_pd_decode_leg_at_the_prefill_finish() -> None:
    p = prompt(800)

    def to_decode(fleet: VirtualFleet, done: RequestResult) -> None:
        if done.engine_index == 0:
            leg = req("d", p, 20, remote_prefilled_tokens=len(p) - 1)
            fleet.submit(fleet.now, 1, leg)
            fleet.release_held(0, done.request_id)

    fleet = VirtualFleet([cfg(), cfg()], on_finish=to_decode)
    fleet.submit(0.0, 0, req("p", p, 1, hold_kv_after_prefill=True))
    prefill, decode = fleet.run()
    assert decode.arrival == prefill.finish_time
    assert decode.num_cached_tokens == 799 and decode.output_tokens == 20
    assert fleet.cores[0].pool.num_free == 255
    assert decode.ttft is not None and prefill.ttft is not None
    assert decode.ttft < prefill.ttft


def test_probe_prefix_reports_the_hit_a_request_would_get_without_changing_anything() -> None:
    core = EngineCore(cfg())
    core.add_request(req("a", prompt(100), 1))
    t = run_core(core)
    assert core.probe_prefix(prompt(100)) == 96
    assert core.probe_prefix(prompt(40) + prompt(60, 9)) == 32
    assert core.probe_prefix(prompt(100), cache_salt="other") == 0
    assert core.stats().prefix_cache_queries == 100
    seq = core.add_request(req("b", prompt(100), 1))
    run_core(core, t)
    assert seq.num_cached_tokens == 96


def test_vllm_can_publish_raw_digests_instead_of_uint64() -> None:
    batches: list[KVEventBatch] = []
    core = EngineCore(cfg(int_block_hashes=False), event_sink=batches.append)
    core.add_request(req("g", GOLDEN["vllm_token_ids"] + [7], 1))
    core.step(0.0)
    [stored] = batches[0].events
    assert isinstance(stored, BlockStored)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)
    low64 = [int.from_bytes(h, "big") & (2**64 - 1) for h in stored.block_hashes]  # type: ignore[arg-type]
    assert low64 == GOLDEN["vllm_block_hashes_uint64"]


def test_virtual_cancel_aborts_a_request_and_frees_its_slot_for_the_next() -> None:
    fleet = VirtualFleet([cfg(max_num_seqs=1)])
    fleet.submit(0.0, 0, req("slow", prompt(50), 1000))
    fleet.submit(0.0, 0, req("next", prompt(50, 900), 3))
    fleet.cancel(0.1, "slow")
    slow, nxt = fleet.run()
    assert (slow.request_id, slow.finish_reason, slow.finish_time) == ("slow", "abort", 0.1)
    assert 0 < slow.output_tokens < 1000
    assert nxt.request_id == "next" and nxt.output_tokens == 3
    assert nxt.first_token_time is not None and nxt.first_token_time > 0.1


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["early", "late", "urgent"]), ("priority", ["urgent", "early", "late"])],
)
def test_the_waiting_order_follows_the_scheduling_policy(policy: str, order: list[str]) -> None:
    """With vLLM's priority policy a waiting request of a lower ``priority`` value goes
    first, ties by arrival; first come, first served ignores the value."""
    core = EngineCore(cfg(max_num_batched_tokens=64, scheduling_policy=policy))
    core.add_request(req("busy", prompt(64)))
    core.step(0.0)  # "busy" takes the whole first step
    core.add_request(req("early", prompt(64, 3000), priority=1))
    core.add_request(req("late", prompt(64, 5000), priority=1))
    core.add_request(req("urgent", prompt(64, 7000), priority=0))
    started: list[str] = []
    t = 0.0
    while len(started) < 3:
        t += core.step(t).duration
        started += [
            s.request_id
            for s in core.running
            if s.request_id not in started and s.request_id != "busy"
        ]
    assert started == order
