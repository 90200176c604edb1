"""``switchyard simulate`` runs the router's flow control: the same queue, saturation check and
fair share, on the simulator's virtual clock."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from switchyard.loadtest.simcli import simulate_command
from switchyard.loadtest.simulate import PolicyRun, SimConfig, run_policy, simulate
from switchyard.loadtest.simworkload import sim_workload
from switchyard.router.settings import Flow

# Two simulated 8B engines; tenant A offers about three times what they prefill, B a trickle
# of short chats beside it.
NOISY = {"rate": 40.0, "duration_s": 2.0}
# The engine admits long prompts into its running batch (its waiting queue and KV usage stay
# under the router's default thresholds), so a router-side cap is what makes it saturated;
# one cap, named, so the figures do not move with the other's default.
CAPPED = Flow(max_inflight_per_worker=4, max_queued_prefill_tokens=0)


def noisy(**overrides: object) -> SimConfig:
    cfg = SimConfig(
        engines=2,
        workload="noisy",
        workload_params=dict(NOISY),
        policies=["kv_aware"],
        flow_settings=CAPPED,
        record_token_times=False,
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def run(**overrides: object) -> PolicyRun:
    return simulate(noisy(**overrides)).runs[0]


def refused(run: PolicyRun) -> int:
    return sum(sum(fig.refused.values()) for fig in run.tenants.values())


def test_each_request_is_its_api_keys_tenant() -> None:
    workload = sim_workload("noisy", 0, dict(NOISY))
    assert workload.tenants is not None
    assert set(workload.tenants) == {"A", "B"}
    assert sim_workload("multiturn", 0, {"rate": 2.0, "duration_s": 1.0}).tenants is None


def test_flow_control_keeps_the_quiet_tenants_ttft_far_below_the_same_run_without_it() -> None:
    fair = run()
    unfair = run(flow=False)
    quiet, drowned = fair.tenants["B"].ttft_ms()["p90"], unfair.tenants["B"].ttft_ms()["p90"]
    assert quiet is not None and drowned is not None
    assert quiet < 0.5 * drowned
    # The quiet tenant barely waits; the flood waits its turn in the router instead.
    assert fair.tenants["B"].wait_ms()["p90"] < fair.tenants["A"].wait_ms()["p90"]
    assert fair.flow and not unfair.flow
    assert unfair.tenants["A"].wait_ms()["p90"] == 0.0


def test_every_request_ends_served_or_refused_and_only_the_served_were_routed() -> None:
    tight = Flow(
        max_inflight_per_worker=1,
        max_queued_prefill_tokens=0,
        max_requests_per_band=20,
        queue_ttl_s=1.0,
    )
    outcome = simulate(noisy(flow_settings=tight))
    result = outcome.runs[0]
    served = sum(fig.served for fig in result.tenants.values())
    assert served + refused(result) == len(outcome.workload)
    assert result.decisions == served == result.summary.ok
    assert result.summary.errors == refused(result)
    assert set(result.refused_by_flow) == {"queue_full", "queue_timeout"}


def test_sheddable_requests_are_refused_at_once_under_saturation() -> None:
    cfg = noisy()
    workload = sim_workload("noisy", cfg.seed, cfg.workload_params)
    assert workload.tenants is not None
    workload.priorities = [-1 if tenant == "A" else 0 for tenant in workload.tenants]
    result = run_policy(cfg, workload, "kv_aware")
    flood, quiet = result.tenants["A"], result.tenants["B"]
    assert flood.refused.get("shed", 0) > flood.requests // 2
    assert flood.served + flood.refused["shed"] == flood.requests
    assert quiet.refused == {} and quiet.served == quiet.requests


def test_without_flow_control_every_request_is_routed_at_its_arrival() -> None:
    result = run(flow=False, flow_settings=Flow(max_inflight_per_worker=1, queue_ttl_s=0.01))
    assert refused(result) == 0
    assert all(max(fig.wait_s) == 0.0 for fig in result.tenants.values())


def test_the_headline_json_has_each_tenants_figures() -> None:
    line = simulate(noisy()).headline()
    assert line["flow"] is True and line["scrape_interval_ms"] == 1000.0
    tenants = line["policies"]["kv_aware"]["tenants"]
    assert set(tenants) == {"A", "B"}
    quiet = tenants["B"]
    assert set(quiet) == {
        "requests", "served", "refused", "ttft_ms", "queue_wait_ms", "served_tokens",
    }  # fmt: skip
    assert set(quiet["ttft_ms"]) == set(quiet["queue_wait_ms"]) == {"p50", "p90"}
    assert quiet["served_tokens"]["prompt"] > 0 and quiet["served_tokens"]["output"] > 0


def test_the_command_prints_the_tenant_table_and_takes_flow_settings() -> None:
    args = [
        "--engines", "2", "--workload", "noisy", "--policy", "kv_aware", "--no-token-times",
        "--param", "rate=40", "--param", "duration_s=1",
        "--flow-option", "max_inflight_per_worker=4", "--scrape-interval-ms", "100", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(simulate_command, args)
    assert result.exit_code == 0, result.output
    assert "Per tenant" in result.output and "wait p90 ms" in result.output
    line = json.loads(result.output.strip().splitlines()[-1])
    assert line["scrape_interval_ms"] == 100.0
    assert set(line["policies"]["kv_aware"]["tenants"]) == {"A", "B"}


@pytest.mark.parametrize(
    ("option", "message"),
    [("no_such=1", "no flow setting(s) no_such"), ("kv_usage=2", "kv_usage")],
)
def test_a_bad_flow_setting_is_a_usage_error(option: str, message: str) -> None:
    result = CliRunner().invoke(simulate_command, ["--flow-option", option])
    assert result.exit_code == 2
    assert message in result.output


def test_saturation_reads_the_engines_waiting_queues_from_the_scrapes() -> None:
    # Any waiting request on an engine makes it saturated: scraped queues hold requests back.
    only_engines = {"max_inflight_per_worker": 0, "max_queued_prefill_tokens": 0}
    strict = run(flow_settings=Flow(queue_depth=0, **only_engines), scrape_interval_ms=100.0)
    lax = Flow(queue_depth=1000, kv_usage=1.0, **only_engines)
    lax_run = run(flow_settings=lax, scrape_interval_ms=100.0)
    assert strict.tenants["A"].wait_ms()["p90"] > 0.0
    assert lax_run.tenants["A"].wait_ms()["p90"] == 0.0
