"""The shipped dashboard, rules and autoscalers on a real Prometheus: every panel
expression and every recording rule returns series from a live stack (services mode,
embedded, P/D and a router without workers, under load and a flood), every alert evaluates
cleanly over metrics that exist, the one alert the stack provokes (no routable worker) goes
pending, and each query KEDA or prometheus-adapter would send returns one series. The
stack and the table live in ``bench/dashboards.py``; ``python -m bench.dashboards`` prints
the same table."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest

from bench.dashboards import (
    EVENT_ONLY,
    RULES,
    Prometheus,
    Result,
    Stack,
    autoscaler_expressions,
    evaluate,
    grafana_to_promql,
    metric_names,
    panel_expressions,
    rule_expressions,
    running,
    table,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="prometheus and promtool are not on the PATH (apt-get install prometheus)",
    ),
]


class Live:
    def __init__(self, stack: Stack, prometheus: Prometheus, results: list[Result]) -> None:
        self.stack = stack
        self.prometheus = prometheus
        self.results = results
        self.table = table(results)

    def of(self, kind: str) -> list[Result]:
        return [r for r in self.results if r.expression.kind == kind]

    def seen(self, name: str) -> int:
        """Series of ``name`` that had a sample during the run (gone stale since or not)."""
        return len(self.prometheus.query(f"last_over_time({name}[10m])"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with running(tmp_path_factory.mktemp("prometheus")) as (stack, prometheus):
        expressions = panel_expressions() + rule_expressions() + autoscaler_expressions()
        results = evaluate(prometheus, expressions)
        print("\n" + table(results))  # the figures, with pytest -s
        yield Live(stack, prometheus, results)


def test_grafana_variables_become_promql() -> None:
    expr = 'sum(rate(x{job=~"$job"}[$__rate_interval])) / sum(increase(y{a="${a}"}[$__range]))'
    assert grafana_to_promql(expr) == 'sum(rate(x{job=~".*"}[30s])) / sum(increase(y{a=".*"}[30s]))'


def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_expressions())} rules found" in done.stdout


def test_every_panel_expression_returns_series(live: Live) -> None:
    panels = live.of("panel")
    assert len(panels) >= 60
    assert not [r for r in panels if r.error], live.table
    empty = [r.expression.title for r in panels if not r.series and not r.names & set(EVENT_ONLY)]
    assert not empty, live.table


def test_event_only_panels_name_families_prometheus_scraped(live: Live) -> None:
    """The counters only a rare fault creates still parse, and their family (its TYPE
    line) reached Prometheus, so the name is the one the services export."""
    known = live.prometheus.known_names()
    event_only = [r for r in live.of("panel") if r.names & set(EVENT_ONLY)]
    assert event_only
    for result in event_only:
        assert result.error is None
        for name in result.names:
            assert name in known or name.removesuffix("_total") in known, result.expression


def test_every_recording_rule_returns_series(live: Live) -> None:
    records = live.of("record")
    assert len(records) >= 6
    assert all(r.series >= 1 and r.error is None for r in records), live.table


def test_every_rule_evaluates_without_error_in_prometheus(live: Live) -> None:
    groups = live.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(rule_expressions())
    assert all(rule["health"] == "ok" for rule in rules), [
        (rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"
    ]


def test_every_alert_reads_metrics_that_exist(live: Live) -> None:
    """A healthy stack leaves most conditions false (no series), so each alert's metrics
    are checked to have had series during the run: a renamed metric fails here."""
    alerts = live.of("alert")
    assert len(alerts) >= 9
    for result in alerts:
        assert result.error is None, result.expression.title
        names = metric_names(result.expression.query)
        assert names, result.expression.title
        for name in names:
            assert live.seen(name) >= 1, f"{result.expression.title}: no {name}"


def test_a_router_without_workers_raises_the_no_routable_worker_alert(live: Live) -> None:
    alerts = live.prometheus.api("alerts")["alerts"]
    raised = [a for a in alerts if a["labels"]["alertname"] == "SwitchyardRouterNoRoutableWorker"]
    assert [a["labels"]["instance"] for a in raised] == [
        f"127.0.0.1:{live.stack.ports['unroutable']}"
    ]
    assert raised[0]["state"] in ("pending", "firing")
    # its 503s make the 5xx ratio non-zero
    (ratio,) = live.prometheus.query(
        "max_over_time(switchyard:router_requests_5xx:ratio_rate5m[10m])"
    )
    assert float(ratio["value"][1]) > 0


def test_the_flood_shows_in_the_scaling_signals(live: Live) -> None:
    query = live.prometheus.query
    (queued,) = query("max_over_time(switchyard:model_queued:sum[10m])")
    assert float(queued["value"][1]) >= 1
    services = f"127.0.0.1:{live.stack.ports['services']}"
    saturated = query(
        f'max_over_time(switchyard_router_model_saturation{{instance="{services}",role="unified"}}[10m])'
    )
    assert [float(s["value"][1]) for s in saturated] == [1.0]
    assert live.seen("switchyard_router_flow_saturated_models") == 1


def test_each_autoscaler_query_returns_the_one_series_it_scales_on(live: Live) -> None:
    """KEDA's prometheus scaler and an External metric read one value: each query of the
    shipped ScaledObject and adapter rules returns exactly one series on the stack."""
    results = live.of("keda") + live.of("adapter")
    assert len(results) == 4
    assert all(r.series == 1 and r.error is None for r in results), live.table


def test_kvstore_instance_label_arrives_as_exported_instance(live: Live) -> None:
    """The kvstore's ``instance`` (an engine) clashes with the target's: Prometheus keeps
    the target's and renames the engine's, which the dashboard and alerts group by."""
    series = live.prometheus.query('switchyard_kvstore_feed_stale{job="switchyard-kvstore"}')
    engines = {s["metric"]["exported_instance"] for s in series}
    assert engines == set(live.stack.healthy)
    assert {s["metric"]["instance"] for s in series} == {f"127.0.0.1:{live.stack.ports['kvstore']}"}
