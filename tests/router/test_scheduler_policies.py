"""The named policies, as configurations of the filter → scorer → picker framework."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest

from switchyard.router.scheduler.framework import Context, Scheduler
from switchyard.router.scheduler.pickers import ConsistentHashPicker, MaxScorePicker
from switchyard.router.scheduler.policies import PolicyError, build_scheduler
from switchyard.router.scheduler.scorers import KVAwareScorer, SessionAffinityScorer


@dataclass
class FakeWorker:
    id: str
    inflight: int = 0
    begun_at: float = 0.0


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


def test_max_score_rotates_ties_past_workers_another_process_began_on() -> None:
    workers = fleet(0, 0, 0, 0)
    now = time.monotonic()
    workers[0].begun_at = now  # a sibling process just sent a request to each of these
    workers[1].begun_at = now
    picker = MaxScorePicker()
    picks = [picker.order(Context(model="m"), workers, [1.0] * 4)[0].id for _ in range(2)]
    assert picks == ["http://w2", "http://w3"]


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
        uses_prefix = False

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


def test_an_option_typo_names_the_field_and_the_allowed_ones() -> None:
    with pytest.raises(PolicyError) as err:
        build_scheduler("kv_aware", {"prefil_weight": 1})
    message = str(err.value)
    assert "'prefil_weight'" in message and "prefill_weight" in message
    assert "tie_tolerance" in message and "\n" not in message


def test_named_policy_options_reach_the_component_that_declares_them() -> None:
    scheduler = build_scheduler("kv_aware", {"prefill_weight": 2.5, "tie_tolerance": 0.1})
    scorer = scheduler.scorers[0][0]
    assert isinstance(scorer, KVAwareScorer) and scorer.prefill_weight == 2.5
    assert isinstance(scheduler.picker, MaxScorePicker) and scheduler.picker.tie_tolerance == 0.1


def test_kv_aware_weights_default_to_their_params_model() -> None:
    scorer = build_scheduler("kv_aware").scorers[0][0]
    assert isinstance(scorer, KVAwareScorer)
    defaults = KVAwareScorer.Params()
    assert (scorer.prefill_weight, scorer.replication_weight) == (
        defaults.prefill_weight,
        defaults.replication_weight,
    )


def test_an_option_of_the_wrong_type_names_the_field() -> None:
    with pytest.raises(PolicyError, match="load_factor"):
        build_scheduler("consistent_hash", {"load_factor": 0.5})


def test_an_option_the_policy_has_no_component_for_is_rejected() -> None:
    with pytest.raises(PolicyError, match="'temperature'"):
        build_scheduler("round_robin", {"temperature": 0.1})


def test_custom_scorer_takes_its_own_options() -> None:
    scheduler = build_scheduler(
        "custom", {"scorers": {"kv_aware": {"weight": 2, "decode_weight": 0.5}}}
    )
    scorer, weight = scheduler.scorers[0]
    assert isinstance(scorer, KVAwareScorer) and (scorer.decode_weight, weight) == (0.5, 2.0)


def test_custom_scorer_rejects_an_option_typo() -> None:
    with pytest.raises(PolicyError, match="unknown option 'decod_weight'"):
        build_scheduler("custom", {"scorers": {"kv_aware": {"decod_weight": 0.5}}})


def test_custom_policy_without_scorers_or_picker_is_an_error() -> None:
    with pytest.raises(PolicyError, match="least_load"):
        build_scheduler("custom")


def test_unknown_picker_is_rejected() -> None:
    with pytest.raises(PolicyError, match="unknown picker 'fastest'"):
        build_scheduler("custom", {"picker": {"name": "fastest"}})


def test_session_scorer_and_consistent_hash_agree_on_the_home_worker() -> None:
    workers = fleet(0, 0, 0, 0, 0)
    picker = ConsistentHashPicker()
    scorer = SessionAffinityScorer()
    for i in range(100):
        ctx = Context(model="m", session_key=f"user-{i}")
        scores = scorer.score(ctx, workers)
        home = workers[scores.index(1.0)]
        assert picker.order(ctx, workers, [0.0] * len(workers))[0] is home
