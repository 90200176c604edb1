"""The offline hit-rate ceiling on workloads small enough to check by hand."""

from __future__ import annotations

import pytest

from switchyard.loadtest.ceiling import ceiling, hit_tokens, prefix_hashes
from switchyard.loadtest.workloads import build_workload

BS = 4


def test_prefix_hashes_chain_so_equal_keys_mean_equal_prefixes() -> None:
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = prefix_hashes([1, 2, 3, 4, 0, 6, 7, 8], BS)
    c = prefix_hashes([0, 0, 0, 0, 5, 6, 7, 8], BS)
    assert len(a) == 2
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]


def test_only_full_blocks_hit_and_the_last_token_is_recomputed() -> None:
    p = list(range(8))
    # second identical prompt: 8 tokens, at most (8-1)//4 = 1 block may hit.
    assert hit_tokens([p, p], [0, 0], BS, None) == (4, 16)
    # a longer prompt with the same 8-token head hits both of its blocks.
    assert hit_tokens([p, [*p, 99]], [0, 0], BS, None) == (8, 17)


def test_unbounded_cache_hits_every_previously_seen_prefix() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 50, 60, 70, 80, 90]
    c = [1, 2, 3, 4, 5, 6, 7, 8, 10]
    cached, total = hit_tokens([a, b, c], [0, 0, 0], BS, None)
    assert (cached, total) == (0 + 4 + 8, 27)


def test_bounded_cache_evicts_least_recently_used_tail_first() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # blocks A1 A2
    b = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # blocks B1 B2
    # capacity 3: after b, A2 (a's tail, least recent) is gone but A1 survives.
    assert hit_tokens([a, b, a], [0, 0, 0], BS, 3) == (4, 27)
    assert hit_tokens([a, b, a], [0, 0, 0], BS, 4) == (8, 27)


def test_output_blocks_take_capacity_but_are_never_hit() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    # 1 leftover prompt token + 7 output tokens = 2 output blocks per request. With
    # capacity 5, b's output blocks push out a's tail; without outputs a survives whole.
    assert hit_tokens([a, b, a], [7, 7, 0], BS, 5) == (4, 27)
    assert hit_tokens([a, b, a], [0, 0, 0], BS, 5) == (8, 27)


def test_ceiling_of_a_workload_reports_both_models() -> None:
    w = build_workload("shared_prefix", 0, rate=20.0, duration_s=1.0, groups=1, prefix_tokens=320)
    roomy = ceiling(w, engines=2, num_gpu_blocks=10_000)
    tight = ceiling(w, engines=1, num_gpu_blocks=8)
    assert roomy.bounded_hit_rate == pytest.approx(roomy.infinite_hit_rate)
    assert roomy.infinite_hit_rate > 0.5
    assert tight.bounded_hit_rate < roomy.bounded_hit_rate
    assert tight.capacity_blocks == 8
