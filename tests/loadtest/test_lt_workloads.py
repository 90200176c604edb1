"""Workloads are fixed by their seed and have the reuse structure they claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.loadtest.text import default_bank
from switchyard.loadtest.workloads import build_workload
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.mock.tokenizer import ModelTokenizer

SMALL = {"rate": 20.0, "duration_s": 3.0}


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(DEFAULT_TOKENIZER)


def test_word_bank_text_has_exactly_the_requested_token_count(tok: ModelTokenizer) -> None:
    bank = default_bank()
    for n in (1, 16, 511, 2048):
        assert len(tok.encode(bank.text("x", n))) == n


def test_word_bank_shorter_text_is_a_prefix_of_longer_with_same_seed() -> None:
    bank = default_bank()
    assert bank.text("k", 700).startswith(bank.text("k", 300))
    assert bank.text("k", 50) != bank.text("other", 50)


@pytest.mark.parametrize("name", ["multiturn", "shared_prefix", "random"])
def test_same_seed_gives_identical_requests_and_other_seed_differs(name: str) -> None:
    a = build_workload(name, 3, **SMALL)
    b = build_workload(name, 3, **SMALL)
    c = build_workload(name, 4, **SMALL)
    assert a.requests == b.requests
    assert [r.messages for r in a.requests] != [r.messages for r in c.requests]


@pytest.mark.parametrize("name", ["multiturn", "shared_prefix", "random"])
def test_arrivals_are_open_loop_at_the_requested_rate(name: str) -> None:
    w = build_workload(name, 1, rate=50.0, duration_s=4.0)
    times = [r.arrival_s for r in w.requests]
    assert len(times) == 200
    assert times == sorted(times)
    assert 3.0 < times[-1] < 5.0


def test_unknown_workload_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match="no parameter"):
        build_workload("random", 0, groups=3)


def test_multiturn_next_turn_extends_the_previous_prompt_and_answer() -> None:
    w = build_workload("multiturn", 2, rate=20.0, duration_s=6.0, active_sessions=4, turns=4)
    last: dict[str, list[dict[str, str]]] = {}
    extended = 0
    for r in w.requests:
        prev = last.get(r.session)
        if prev is not None:
            assert r.messages[: len(prev)] == prev
            assert [m["role"] for m in r.messages[len(prev) :]] == ["assistant", "user"]
            extended += 1
        last[r.session] = r.messages
        assert len(r.messages) <= 1 + 2 * 4 - 1
    assert extended > len(w.requests) // 2


def test_multiturn_sessions_of_a_tenant_share_the_system_prompt(tok: ModelTokenizer) -> None:
    w = build_workload("multiturn", 5, system_tokens=300, **SMALL)
    by_tenant: dict[str, set[str]] = {}
    for r in w.requests:
        by_tenant.setdefault(r.tenant, set()).add(r.messages[0]["content"])
    assert all(len(prompts) == 1 for prompts in by_tenant.values())
    assert len({next(iter(p)) for p in by_tenant.values()}) == len(by_tenant)
    assert len(tok.encode(next(iter(by_tenant.values())).pop())) == 300


def test_shared_prefix_requests_of_a_group_share_leading_tokens(tok: ModelTokenizer) -> None:
    w = build_workload("shared_prefix", 0, groups=2, prefix_tokens=256, **SMALL)
    groups: dict[str, list[list[int]]] = {}
    for r in w.requests:
        groups.setdefault(r.tenant, []).append(tok.tokenize_chat(r.messages))
    assert len(groups) == 2
    for prompts in groups.values():
        heads = {tuple(p[:256]) for p in prompts}
        assert len(heads) == 1
        assert len({tuple(p[:300]) for p in prompts}) > 1
    a, b = (g[0][:256] for g in groups.values())
    assert a[3:19] != b[3:19]


def test_random_prompts_share_no_full_block(tok: ModelTokenizer) -> None:
    w = build_workload("random", 0, prompt_tokens=(40, 80), **SMALL)
    seen: set[tuple[int, ...]] = set()
    for r in w.requests:
        head = tuple(tok.tokenize_chat(r.messages)[:16])
        assert head not in seen
        seen.add(head)


def _trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> str:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
        for t, n, o, ids in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_mooncake_equal_hash_ids_give_equal_512_token_blocks(
    tmp_path: Path, tok: ModelTokenizer
) -> None:
    trace = _trace(
        tmp_path / "t.jsonl",
        [(0, 1200, 10, [7, 8, 9]), (1000, 1500, 20, [7, 8, 11]), (3000, 300, 5, [12])],
    )
    w = build_workload("mooncake", 0, trace=trace)
    a, b, c = (r.messages[0]["content"] for r in w.requests)
    ta, tb, tc = tok.encode(a), tok.encode(b), tok.encode(c)
    assert (len(ta), len(tb), len(tc)) == (1200, 1500, 300)
    assert ta[:1024] == tb[:1024]
    assert ta[1024:1040] != tb[1024:1040]
    assert tb[:512] != tc[:300]


def test_mooncake_partial_last_block_is_a_prefix_of_the_full_block(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [(0, 600, 1, [1, 2]), (5, 1024, 1, [1, 2])])
    short, full = (
        r.messages[0]["content"] for r in build_workload("mooncake", 0, trace=trace).requests
    )
    assert full.startswith(short)


def test_mooncake_timestamps_scale_and_output_caps(tmp_path: Path) -> None:
    trace = _trace(
        tmp_path / "t.jsonl",
        [(5000, 100, 900, [1]), (7000, 100, 9, [2]), (9000, 100, 9, [3]), (11000, 100, 9, [4])],
    )
    w = build_workload(
        "mooncake", 0, trace=trace, speedup=4.0, start=1, limit=2, max_output_tokens=8
    )
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5]
    assert [r.max_tokens for r in w.requests] == [8, 8]


def test_mooncake_block_tokens_shrinks_prompts_keeping_reuse(
    tmp_path: Path, tok: ModelTokenizer
) -> None:
    trace = _trace(tmp_path / "t.jsonl", [(0, 1024, 1, [1, 2]), (1, 1024, 1, [1, 3])])
    a, b = (
        tok.encode(r.messages[0]["content"])
        for r in build_workload("mooncake", 0, trace=trace, block_tokens=128).requests
    )
    assert len(a) == len(b) == 256
    assert a[:128] == b[:128] and a[128:] != b[128:]


def test_real_mooncake_trace_blocks_are_512_tokens(tok: ModelTokenizer) -> None:
    from switchyard.loadtest.workloads.mooncake import DEFAULT_TRACE

    trace = Path(__file__).resolve().parents[2] / DEFAULT_TRACE
    if not trace.exists():
        pytest.skip(f"trace not present at {trace}")
    w = build_workload("mooncake", 0, trace=str(trace), limit=3)
    first = json.loads(trace.read_text().splitlines()[0])
    tokens = tok.encode(w.requests[0].messages[0]["content"])
    assert len(tokens) == first["input_length"]
