"""``switchyard simulate`` runs the router's tenant rate limits: ``TenantRateLimiter`` on the
simulation's virtual clock, reserved at arrival before queueing, settled on the real tokens
at the end, refunded for a request refused later."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner

from switchyard.loadtest import simulate as simulate_module
from switchyard.loadtest.client import Result
from switchyard.loadtest.simcli import simulate_command
from switchyard.loadtest.simulate import PolicyRun, SimConfig, run_policy, simulate
from switchyard.loadtest.simworkload import sim_workload
from switchyard.router.flow.ratelimit import Reservation, TenantRateLimiter
from switchyard.router.settings import Flow

# Tenant A offers 10 requests a second of 200-300 prompt tokens and 16 output tokens, about
# 160,000 tokens a minute, twice its limit; B sends 2 short chats a second, unlimited. Two
# engines serve both with room to spare, so only the rate limit holds A back.
LIMIT = 80_000
TWO_MINUTES = {
    "rate": 10.0,
    "duration_s": 120.0,
    "flood_x": 1.0,
    "quiet_share": 0.2,
    "flood_prompt_tokens": [200, 300],
}


def limited(flow: Flow, **params: object) -> SimConfig:
    return SimConfig(
        engines=2,
        workload="noisy",
        workload_params={**TWO_MINUTES, **params},
        policies=["kv_aware"],
        flow_settings=flow,
        record_token_times=False,
    )


@pytest.fixture
def results(monkeypatch: pytest.MonkeyPatch) -> list[Result]:
    """Every request's client record of the next run (the report keeps only figures)."""
    seen: list[Result] = []
    figures = simulate_module.tenant_figures

    def keep(results: list[Result], waits: dict[int, float]) -> Any:
        seen.extend(results)
        return figures(results, waits)

    monkeypatch.setattr(simulate_module, "tenant_figures", keep)
    return seen


def served_tokens(results: list[Result], tenant: str, keep: Callable[[Result], bool]) -> int:
    return sum(
        r.prompt_tokens + r.output_tokens
        for r in results
        if r.tenant == tenant and r.ok and keep(r)
    )


def test_a_tenant_offering_twice_its_tokens_per_minute_is_held_to_it(
    results: list[Result],
) -> None:
    run = simulate(limited(Flow(tenant_tokens_per_minute={"A": LIMIT}))).runs[0]
    flood, quiet = run.tenants["A"], run.tenants["B"]
    offered = sum(r.prompt_tokens + 16 for r in results if r.tenant == "A")
    assert 1.8 * 2 * LIMIT < offered < 2.2 * 2 * LIMIT
    # The bucket starts full: the first minute admits its budget plus a minute's refill,
    # and from then on the limit.
    second_minute = served_tokens(results, "A", lambda r: 60.0 <= r.sent_s < 120.0)
    assert abs(second_minute - LIMIT) <= 0.1 * LIMIT
    # From the first refusal (the bucket just dry) to the end: the limit's own rate.
    first = min(r.sent_s for r in results if r.tenant == "A" and not r.ok)
    since = served_tokens(results, "A", lambda r: r.sent_s >= first)
    assert abs(since - LIMIT * (120.0 - first) / 60.0) <= 0.02 * LIMIT
    assert flood.prompt_tokens + flood.output_tokens == served_tokens(results, "A", lambda r: True)
    # Refused as the router refuses: 429 rate_limited, at once, never routed.
    assert flood.refused.get("rate_limited", 0) > flood.requests // 4
    assert flood.served + flood.refused["rate_limited"] == flood.requests
    assert run.refused_by_flow == {"rate_limited": flood.refused["rate_limited"]}
    assert all(r.status == 429 and r.reason == "rate_limited" for r in results if not r.ok)
    assert run.decisions == flood.served + quiet.served
    # The other tenant is untouched.
    assert quiet.refused == {} and quiet.served == quiet.requests > 100
    assert quiet.wait_ms()["p90"] == 0.0


def test_requests_per_minute_hold_every_tenant_but_the_exempt_one() -> None:
    # Every tenant 300 requests a minute but B, exempt (0); A offers about 600 a minute.
    flow = Flow(tenant_requests_per_minute={"*": 300, "B": 0})
    run = simulate(limited(flow)).runs[0]
    flood, quiet = run.tenants["A"], run.tenants["B"]
    assert 1100 < flood.requests < 1300
    # A full bucket of 300, then two minutes' refill of 300 each.
    assert abs(flood.served - 900) <= 0.05 * 900
    assert flood.refused == {"rate_limited": flood.requests - flood.served}
    assert quiet.refused == {} and quiet.served == quiet.requests


class Recording(TenantRateLimiter):
    """The limiter with every reservation and how it ended kept."""

    made: ClassVar[list[Recording]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reserved: list[Reservation] = []
        self.settled: list[tuple[int, int]] = []
        self.cancelled = 0
        Recording.made.append(self)

    def reserve(self, tenant: str, prompt_tokens: int, max_tokens: int | None) -> Reservation:
        reservation = super().reserve(tenant, prompt_tokens, max_tokens)
        assert reservation is not None
        self.reserved.append(reservation)
        return reservation

    def settle(self, reservation: Reservation, prompt_tokens: int, output_tokens: int) -> None:
        assert reservation.open
        self.settled.append((prompt_tokens, output_tokens))
        super().settle(reservation, prompt_tokens, output_tokens)

    def cancel(self, reservation: Reservation) -> None:
        assert reservation.open
        self.cancelled += 1
        super().cancel(reservation)


def test_every_reservation_is_settled_when_served_or_refunded_when_refused_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Recording.made.clear()
    monkeypatch.setattr(simulate_module, "TenantRateLimiter", Recording)
    # A limit no tenant reaches, on a fleet too small for the flood: A's excess is shed
    # (sheddable), or refused queue_full or queue_timeout, each after its reservation.
    tight = Flow(
        max_inflight_per_worker=1,
        max_queued_prefill_tokens=0,
        max_requests_per_band=20,
        queue_ttl_s=1.0,
        tenant_tokens_per_minute={"*": 10**9},
    )
    cfg = SimConfig(
        engines=2,
        workload="noisy",
        workload_params={"rate": 40.0, "duration_s": 2.0},
        policies=["kv_aware"],
        flow_settings=tight,
        record_token_times=False,
    )
    workload = sim_workload("noisy", cfg.seed, cfg.workload_params)
    assert workload.tenants is not None
    workload.priorities = [-1 if i % 4 == 0 else 0 for i in range(len(workload))]
    run: PolicyRun = run_policy(cfg, workload, "kv_aware")
    (limiter,) = Recording.made
    served = sum(fig.served for fig in run.tenants.values())
    refused = sum(sum(fig.refused.values()) for fig in run.tenants.values())
    assert set(run.refused_by_flow) == {"shed", "queue_full", "queue_timeout"}
    assert len(limiter.reserved) == len(workload) == served + refused
    assert len(limiter.settled) == served and limiter.cancelled == refused
    assert not any(r.open for r in limiter.reserved)
    prompt = sum(fig.prompt_tokens for fig in run.tenants.values())
    output = sum(fig.output_tokens for fig in run.tenants.values())
    assert sum(p for p, _ in limiter.settled) == prompt
    assert sum(o for _, o in limiter.settled) == output


def test_without_limits_no_limiter_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    Recording.made.clear()
    monkeypatch.setattr(simulate_module, "TenantRateLimiter", Recording)
    run = simulate(limited(Flow(tenant_tokens_per_minute={"A": 0}), duration_s=5.0)).runs[0]
    assert Recording.made == []
    assert run.refused_by_flow == {}


def test_the_command_takes_rate_limits_as_json_and_reports_each_tenants_refusals() -> None:
    args = [
        "--engines", "2", "--workload", "noisy", "--policy", "kv_aware", "--no-token-times",
        "--param", "rate=10", "--param", "duration_s=30", "--param", "flood_x=1",
        "--param", "flood_prompt_tokens=[200,300]",
        "--flow-option", 'tenant_tokens_per_minute={"A": 20000}', "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(simulate_command, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "tenant rate limits: tokens per minute A 20000" in result.output
    table = result.output.strip().splitlines()[:-1]  # the per-tenant table's rows
    rows = [line.split("│")[2].strip() for line in table if "rate_limited" in line]
    assert rows == ["A"]
    line = json.loads(result.output.strip().splitlines()[-1])
    policy = line["policies"]["kv_aware"]
    flood, quiet = policy["tenants"]["A"], policy["tenants"]["B"]
    assert flood["refused"]["rate_limited"] > 0
    assert policy["refused"] == {"rate_limited": flood["refused"]["rate_limited"]}
    assert quiet["refused"] == {} and quiet["served"] == quiet["requests"]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ('tenant_tokens_per_minute={"A": -1}', "rate limit of 'A' is negative"),
        ("tenant_tokens_per_minute=60000", "tenant_tokens_per_minute: Input should be a valid"),
        ('tenant_requests_per_minute={"A": "x"}', "tenant_requests_per_minute.A"),
    ],
)
def test_a_bad_rate_limit_is_a_one_line_usage_error(option: str, message: str) -> None:
    result = CliRunner().invoke(simulate_command, ["--flow-option", option])
    assert result.exit_code == 2
    assert message in result.output
