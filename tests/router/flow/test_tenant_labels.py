"""Flow control's tenant label is bounded to the tenants served the most tokens lately: at
most ``MAX_TENANT_LABELS`` hold their own label, the rest share ``other``, and a tenant
that comes later with more traffic takes the label of the lightest one. In-process, on an
injected clock, ranked at each ``flush_served`` as before a scrape."""

from __future__ import annotations

import random
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from switchyard.router.metrics import (
    MAX_TENANT_LABELS,
    OTHER_TENANT,
    TENANT_RANK_HALF_LIFE_S,
    TENANT_RANK_MARGIN,
    FlowMetrics,
    RouterMetrics,
    flush_metric_files,
)

SERVED = "switchyard_router_flow_served_tokens_total"
LIGHT = [f"light-{i:02d}" for i in range(MAX_TENANT_LABELS + 4)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def flow_metrics() -> tuple[FlowMetrics, RouterMetrics, Clock]:
    clock = Clock()
    router = RouterMetrics()
    return FlowMetrics(router, clock), router, clock


def series(registry: CollectorRegistry) -> dict[str, dict[str, float]]:
    """The served-tokens series a scrape of ``registry`` shows: tenant -> kind -> tokens."""
    found: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == SERVED:
                tenant, kind = sample.labels["tenant"], sample.labels["kind"]
                found.setdefault(tenant, {})[kind] = sample.value
    return found


def own_labels(registry: CollectorRegistry) -> set[str]:
    return set(series(registry)) - {OTHER_TENANT}


def first_twenty_light_then_one_heavy(flow: FlowMetrics, clock: Clock) -> None:
    """The first twenty tenants seen are light (light-00 the lightest); a minute later a
    heavy tenant comes, with four more light ones."""
    for i, tenant in enumerate(LIGHT[:MAX_TENANT_LABELS]):
        flow.served(tenant, 10 + i, 0)
    flow.flush_served()
    clock.now += 60
    flow.served("heavy", 400, 100)
    for tenant in LIGHT[MAX_TENANT_LABELS:]:
        flow.served(tenant, 10, 0)
    flow.flush_served()


def test_a_heavy_tenant_coming_after_twenty_light_ones_takes_the_lightest_ones_label() -> None:
    flow, router, clock = flow_metrics()
    first_twenty_light_then_one_heavy(flow, clock)
    shown = series(router.registry)
    assert shown["heavy"] == {"prompt": 400, "output": 100}
    assert "light-00" not in shown  # evicted: its series is gone
    assert own_labels(router.registry) == {"heavy", *LIGHT[1:MAX_TENANT_LABELS]}
    # The later light tenants share "other": not heavier than the lightest by the margin.
    assert shown[OTHER_TENANT] == {"prompt": 10 * 4}
    assert flow.tenant_label("light-00") == OTHER_TENANT
    assert flow.tenant_label("heavy") == "heavy"


def test_an_evicted_tenants_later_tokens_count_under_other() -> None:
    flow, router, clock = flow_metrics()
    first_twenty_light_then_one_heavy(flow, clock)
    flow.served("light-00", 3, 2)
    flow.served("heavy", 7, 0)
    flow.flush_served()
    shown = series(router.registry)
    assert "light-00" not in shown
    assert shown[OTHER_TENANT] == {"prompt": 10 * 4 + 3, "output": 2}
    assert shown["heavy"] == {"prompt": 407, "output": 100}


def test_the_first_tenants_seen_take_the_free_labels() -> None:
    flow, router, _ = flow_metrics()
    for tenant in LIGHT[:MAX_TENANT_LABELS]:
        flow.served(tenant, 1, 1)
    flow.served(LIGHT[MAX_TENANT_LABELS], 1, 1)
    flow.flush_served()
    assert own_labels(router.registry) == set(LIGHT[:MAX_TENANT_LABELS])
    assert series(router.registry)[OTHER_TENANT] == {"prompt": 1, "output": 1}


def test_a_tenant_needs_more_than_the_margin_over_the_lightest_to_take_its_label() -> None:
    flow, router, _ = flow_metrics()
    for tenant in LIGHT[:MAX_TENANT_LABELS]:
        flow.served(tenant, 100, 0)
    flow.flush_served()
    flow.served("close", int(100 * TENANT_RANK_MARGIN), 0)  # as much as the margin: not more
    flow.flush_served()
    assert "close" not in own_labels(router.registry)
    flow.served("close", 1, 0)
    flow.flush_served()
    assert "close" in own_labels(router.registry)
    assert len(own_labels(router.registry)) == MAX_TENANT_LABELS


def test_two_tenants_of_like_traffic_do_not_swap_the_label_back_and_forth() -> None:
    flow, router, clock = flow_metrics()
    rival, held = "rival", "held"
    for round_ in range(50):
        clock.now += 10
        for tenant in LIGHT[: MAX_TENANT_LABELS - 1]:  # well ahead of both
            flow.served(tenant, 1000, 0)
        # The one served more in the latest round is ahead, by far less than the margin:
        # the rival after every other round. The first round gives the last label to held.
        flow.served(rival, 120 if round_ % 2 else 80, 0)
        flow.served(held, 80 if round_ % 2 else 120, 0)
        flow.flush_served()
        assert flow.tenant_label(held) == held
        assert flow.tenant_label(rival) == OTHER_TENANT


def test_tokens_served_long_ago_count_less_than_tokens_served_now() -> None:
    flow, router, clock = flow_metrics()
    for tenant in LIGHT[:MAX_TENANT_LABELS]:
        flow.served(tenant, 1000, 0)
    flow.flush_served()
    clock.now += 3 * TENANT_RANK_HALF_LIFE_S  # their 1000 now weigh 125
    flow.served("newcomer", 200, 0)  # more than 125 by the margin; fewer than 1000
    flow.flush_served()
    assert flow.tenant_label("newcomer") == "newcomer"
    assert len(own_labels(router.registry)) == MAX_TENANT_LABELS


def test_the_labelled_tenants_never_exceed_the_limit_as_traffic_moves() -> None:
    flow, router, clock = flow_metrics()
    rng = random.Random(7)
    tenants = [f"t{i}" for i in range(200)]
    ever_labelled: set[str] = set()
    for round_ in range(300):
        clock.now += 5
        # Every 30 rounds ten other tenants turn heavy; a scatter of light ones comes along.
        heavy = tenants[(round_ // 30) * 10 : (round_ // 30) * 10 + 10]
        for tenant in heavy + rng.sample(tenants, 15):
            flow.served(tenant, 500 if tenant in heavy else rng.randint(1, 20), 0)
        flow.flush_served()
        labelled = own_labels(router.registry)
        assert len(labelled) <= MAX_TENANT_LABELS
        assert flow.tenant_label(OTHER_TENANT) == OTHER_TENANT
        if round_ % 30 == 29:  # by the end of their turn, the heavy ones have labels
            assert set(heavy) <= labelled
        ever_labelled |= labelled
    assert len(ever_labelled) > 5 * MAX_TENANT_LABELS  # the labels followed the traffic


def test_the_queued_gauge_follows_the_labels() -> None:
    flow, router, clock = flow_metrics()
    flow.watch(lambda: {(0, "light-00"): 2, (0, "heavy"): 3, (0, "light-01"): 1}, lambda: [])
    first_twenty_light_then_one_heavy(flow, clock)
    sample = router.registry.get_sample_value
    assert sample("switchyard_router_flow_queued", {"band": "0", "tenant": "heavy"}) == 3
    assert sample("switchyard_router_flow_queued", {"band": "0", "tenant": OTHER_TENANT}) == 2
    assert sample("switchyard_router_flow_queued", {"band": "0", "tenant": "light-01"}) == 1


def test_a_tenant_named_other_counts_in_the_shared_series() -> None:
    flow, router, clock = flow_metrics()
    flow.served(OTHER_TENANT, 5, 0)
    flow.flush_served()
    first_twenty_light_then_one_heavy(flow, clock)
    assert own_labels(router.registry) == {"heavy", *LIGHT[1:MAX_TENANT_LABELS]}
    assert series(router.registry)[OTHER_TENANT] == {"prompt": 5 + 10 * 4}


# -- under --processes: the series live in the processes' metric files ------------------


def summed(directory: Path) -> CollectorRegistry:
    """What a /metrics over the directory's files sums."""
    flush_metric_files()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return registry


async def test_in_the_files_an_evicted_tenants_series_stays_at_its_last_value(
    metric_dir: Path,
) -> None:
    flow, _, clock = flow_metrics()
    first_twenty_light_then_one_heavy(flow, clock)
    flow.served("light-00", 3, 0)
    flow.flush_served()
    shown = series(summed(metric_dir))
    assert shown["light-00"] == {"prompt": 10}  # the files keep it; it counts no more
    assert shown[OTHER_TENANT] == {"prompt": 10 * 4 + 3}
    assert shown["heavy"] == {"prompt": 400, "output": 100}
    assert flow.tenant_label("light-00") == OTHER_TENANT


async def test_in_the_files_at_most_twice_the_limit_of_tenants_ever_take_a_label(
    metric_dir: Path,
) -> None:
    flow, _, clock = flow_metrics()
    for tenant in LIGHT[:MAX_TENANT_LABELS]:
        flow.served(tenant, 10, 0)
    flow.flush_served()
    # Ever heavier newcomers, one at a time: each takes a label until twice the limit have.
    newcomers = [f"new-{i:02d}" for i in range(MAX_TENANT_LABELS + 5)]
    for i, tenant in enumerate(newcomers):
        clock.now += 1
        flow.served(tenant, 100 * (i + 1), 0)
        flow.flush_served()
    labelled_now = {t for t in [*LIGHT, *newcomers] if flow.tenant_label(t) != OTHER_TENANT}
    assert labelled_now == set(newcomers[:MAX_TENANT_LABELS])
    shown = series(summed(metric_dir))
    assert len(set(shown) - {OTHER_TENANT}) == 2 * MAX_TENANT_LABELS
    for tenant in newcomers[MAX_TENANT_LABELS:]:
        assert tenant not in shown
    # One labelled before takes a label back, resuming its series in the files.
    clock.now += 1
    flow.served("light-05", 100_000, 0)
    flow.flush_served()
    assert flow.tenant_label("light-05") == "light-05"
    assert series(summed(metric_dir))["light-05"] == {"prompt": 10 + 100_000}
