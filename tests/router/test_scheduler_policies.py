"""The named policies, as configurations of the filter → scorer → picker framework."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from router.scheduler.framework import Context, Scheduler
from router.scheduler.pickers import MaxScorePicker
from router.scheduler.policies import build_scheduler


@dataclass
class FakeWorker:
    id: str
    inflight: int = 0


def fleet(*loads: int) -> list[FakeWorker]:
    return [FakeWorker(f"http://w{i}", load) for i, load in enumerate(loads)]


def first_choices(policy: str, workers: list, n: int, **ctx: object) -> Counter[str]:
    scheduler = build_scheduler(policy, {"seed": 7})
    return Counter(scheduler.schedule(Context(model="m", **ctx), workers)[0].id for _ in range(n))


def test_every_order_holds_every_candidate_once() -> None:
    workers = fleet(0, 3, 1, 2)
    for policy in ("round_robin", "random", "least_load", "power_of_two", "consistent_hash"):
        order = build_scheduler(policy).schedule(Context(model="m", session_key="s"), workers)
        assert sorted(w.id for w in order) == sorted(w.id for w in workers), policy


def test_round_robin_takes_turns() -> None:
    assert first_choices("round_robin", fleet(0, 0, 0), 9) == Counter(
        {"http://w0": 3, "http://w1": 3, "http://w2": 3}
    )


def test_random_spreads_over_all_workers() -> None:
    counts = first_choices("random", fleet(0, 0, 0, 0), 400)
    assert len(counts) == 4 and min(counts.values()) > 50


def test_least_load_picks_the_fewest_inflight() -> None:
    assert first_choices("least_load", fleet(5, 1, 3), 20) == Counter({"http://w1": 20})


def test_least_load_breaks_ties_at_random() -> None:
    counts = first_choices("least_load", fleet(2, 0, 0), 200)
    assert set(counts) == {"http://w1", "http://w2"}


def test_power_of_two_never_picks_the_most_loaded() -> None:
    counts = first_choices("power_of_two", fleet(1, 2, 3, 9), 300)
    assert "http://w3" not in counts
    assert counts["http://w0"] > counts["http://w2"]


def test_consistent_hash_keeps_a_session_on_one_worker() -> None:
    counts = first_choices("consistent_hash", fleet(0, 0, 0, 0), 50, session_key="alice")
    assert len(counts) == 1


def test_consistent_hash_spreads_sessions() -> None:
    scheduler = build_scheduler("consistent_hash")
    workers = fleet(0, 0, 0, 0)
    owners = {
        scheduler.schedule(Context(model="m", session_key=f"user-{i}"), workers)[0].id
        for i in range(200)
    }
    assert len(owners) == 4


def test_consistent_hash_bounded_load_moves_a_hot_session() -> None:
    scheduler = build_scheduler("consistent_hash", {"load_factor": 1.25})
    workers = fleet(0, 0, 0, 0)
    home = scheduler.schedule(Context(model="m", session_key="hot"), workers)[0]
    home.inflight = 10
    moved = scheduler.schedule(Context(model="m", session_key="hot"), workers)[0]
    assert moved.id != home.id


def test_consistent_hash_without_session_key_uses_load() -> None:
    assert first_choices("consistent_hash", fleet(4, 0, 4), 10) == Counter({"http://w1": 10})


def test_custom_policy_from_yaml_options() -> None:
    scheduler = build_scheduler(
        "custom", {"scorers": {"load": 1.0}, "picker": {"name": "max_score"}}
    )
    assert isinstance(scheduler.picker, MaxScorePicker)
    assert scheduler.schedule(Context(model="m"), fleet(3, 1))[0].id == "http://w1"


def test_max_inflight_filter_drops_full_workers() -> None:
    scheduler = build_scheduler("round_robin", {"filters": {"max_inflight": 2}})
    order = scheduler.schedule(Context(model="m"), fleet(2, 1, 5))
    assert [w.id for w in order] == ["http://w1"]


def test_weighted_scorers_are_averaged() -> None:
    class Prefers(str):
        name = "prefers"

        def score(self, ctx: Context, workers: list) -> list[float]:
            return [1.0 if w.id == self else 0.0 for w in workers]

    workers = fleet(0, 0)
    scheduler = Scheduler(
        policy="test",
        picker=MaxScorePicker(),
        scorers=[(Prefers("http://w0"), 1.0), (Prefers("http://w1"), 3.0)],
    )
    assert scheduler.combined_scores(Context(model="m"), workers) == [0.25, 0.75]
    assert scheduler.schedule(Context(model="m"), workers)[0].id == "http://w1"


@pytest.mark.parametrize("bad", ["fastest", ""])
def test_unknown_policy_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        build_scheduler(bad)


def test_unknown_scorer_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown scorer"):
        build_scheduler("custom", {"scorers": {"vibes": 1.0}})
