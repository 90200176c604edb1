"""Priority bands: an interactive band's TTFT beside a batch flood, and sheddable work refused
at once under saturation.

One tenant (no API key) sends three bands (``switchyard.loadtest.workloads.bands``) through
a slowed mock fleet whose engines take ``--step-tokens`` prompt tokens a step (vLLM's
``max_num_batched_tokens``; 2048, vLLM's budget on GPUs under 70 GiB and on CPU):

  batch        long prompts, no ``x-priority`` (band 0), at ``--batch-x`` times the
               fleet's prefill capacity
  interactive  short chats, ``x-priority: high``, at ``--interactive-share`` of it
  sheddable    short requests, ``x-priority: low`` (band -1), at ``--sheddable-share``

Per target and repeat, each on a fresh router over an idle fleet: the interactive band
alone (solo), then all three (flood). Targets: our router with flow control on and
``--flow-max-queued-prefill-tokens`` at the step budget (a worker holding a step's worth
of prompt tokens not yet prefilled counts as saturated), and, unless ``--no-flow-off``,
with ``--no-flow-enabled``: every request routed at once, queued in the engines;
``--ours-args`` adds flow control on with more flags.

The fleet's prefill capacity comes from the mock's timing model: a full step takes
``step_base_us + prefill_token_us * step_tokens`` model microseconds, over ``--speed`` in
wall time; ``rate`` is that over the batch band's mean prompt, in batch requests a second.

Printed per target (medians over ``--repeats``):
  hi solo p90       the interactive band's TTFT p90 alone, ms
  hi p50 / p90      its TTFT beside the flood, ms; p90/solo: target at most 5; and the
                    p90's excess over solo in full engine steps (a step the flood fills
                    takes ``step_tokens`` over one engine's share of the capacity)
  batch share       the batch band's answered tokens a second over the prefill capacity
  low ok/refused    the sheddable band's answered and refused requests
  low 429 max ms    the slowest refusal of a sheddable request: target well under 1 s
  any 429 max ms    the slowest refusal of any band; the reasons are listed below the
                    table, and those that came without a Retry-After
  lost              sent - answered - refused; must be 0

``--case chunked`` runs two tenants instead, on engines that chunk a long prompt over
steps (the fairness bench's chunked case, ``bench.fairness --case chunked``): 4 engines of
4,096 tokens a step, a flood tenant's 2,000-4,000-token prompts with ``x-priority: -1``
(sheddable) at ``--batch-x`` times the capacity, a quiet tenant's 4-turn chats with
``x-priority: 1`` at ``--interactive-share`` of it, told apart by API key, through our
router with ``--processes 3``. In the table the flood is the ``low`` band and its share the
batch share; the target is the quiet tenant's p90 within 2 full steps of its solo p90,
and every flood request answered or refused at once.

Run:  python -m bench.priority [--case default|chunked] [--engines 2] [--speed 0.1]
                               [--step-tokens 2048]
                               [--duration 30] [--repeats 1] [--batch-x 3]
                               [--interactive-share 0.2] [--sheddable-share 0.2]
                               [--no-flow-off] [--ours-args '--flow-...'] [--seed 1]
                               [--engine-priority]
                               [--rev REV]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from bench.fairness import (
    CASES,
    STEPS_OVER_SOLO,
    KeyedSpec,
    Run,
    fmt,
    median,
    run_case,
    with_priorities,
)
from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads.bands import (
    BATCH,
    INTERACTIVE,
    SHEDDABLE,
    BandsParams,
    bands,
)
from switchyard.loadtest.workloads.noisy import NoisyParams, noisy
from switchyard.mock.engine.config import EngineConfig
from tools.worktree import worktree

FLOW_ON, FLOW_OFF = "flow on", "flow off"
SOLO_X = 5.0  # the interactive band's flood p90 over its solo p90, at most
REFUSAL_S = 1.0  # a refusal slower than this is not "at once"


def step_capacity(engines: int, speed: float, step_tokens: int) -> float:
    """The fleet's prompt tokens a wall second at full steps of ``step_tokens``, from the
    mock's timing model."""
    c = EngineConfig()
    step_s = (c.step_base_us + c.prefill_token_us * step_tokens) / 1e6
    return engines * speed * step_tokens / step_s


def targets(step_tokens: int, flow_off: bool, more: str) -> list[KeyedSpec]:
    on = ("--flow-max-queued-prefill-tokens", str(step_tokens))
    specs = [KeyedSpec(FLOW_ON, "switchyard", "kv_aware", extra=on)]
    if more:
        label = f"{FLOW_ON} {more}"
        specs.append(KeyedSpec(label, "switchyard", "kv_aware", extra=(*on, *shlex.split(more))))
    if flow_off:
        specs.append(KeyedSpec(FLOW_OFF, "switchyard", "kv_aware", extra=("--no-flow-enabled",)))
    return specs


@dataclass
class Cell:
    """One target's figures over the repeats."""

    solo_p90: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p90: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    low_ok: list[int] = field(default_factory=list)
    low_refused: list[int] = field(default_factory=list)
    hi_refused: int = 0
    low_refusal_max_ms: list[float] = field(default_factory=list)
    refusal_max_ms: list[float] = field(default_factory=list)
    no_retry_after: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    lost: int = 0

    def add(self, solo: Run, flood: Run) -> None:
        for run, xs in ((solo, self.solo_p90), (flood, self.p90)):
            v = run.quiet_ttft_ms(90)
            if v is not None:
                xs.append(v)
        if (v := flood.quiet_ttft_ms(50)) is not None:
            self.p50.append(v)
        self.share.append(flood.flood_share)
        low = flood.of(SHEDDABLE)
        self.low_ok.append(sum(1 for r in low if r.ok))
        refused = [*solo.refused, *flood.refused]
        self.low_refused.append(sum(1 for r in flood.refused if r.tenant == SHEDDABLE))
        self.hi_refused += sum(1 for r in refused if r.tenant == INTERACTIVE)
        times = [r.e2e_s for r in flood.refused if r.tenant == SHEDDABLE and r.e2e_s is not None]
        if times:
            self.low_refusal_max_ms.append(max(times) * 1e3)
        times = [r.e2e_s for r in refused if r.e2e_s is not None]
        if times:
            self.refusal_max_ms.append(max(times) * 1e3)
        for r in refused:
            key = f"{r.tenant} {r.status} {r.reason or '-'}"
            self.reasons[key] += 1
            if not r.retry_after:
                self.no_retry_after[key] += 1
        self.lost += solo.lost + flood.lost
        for r in [*solo.results, *flood.results]:
            if not r.ok and not r.reason:  # not a refusal of flow control's
                self.errors[r.error[:120]] += 1


def report(cells: dict[str, Cell], header: str, step_ms: float, within_steps: bool = False) -> None:
    """``within_steps``: the target is the interactive p90 within ``STEPS_OVER_SOLO`` full
    steps of its solo p90, not ``SOLO_X`` times it."""
    print(header)
    print(f"one full engine step: {step_ms:.0f} ms")
    head = (
        "| target | hi solo p90 ms | hi p50 ms | hi p90 ms | hi p90/solo "
        "| (hi p90 - solo) in steps | hi refused "
        "| batch share | low ok/refused | low 429 max ms | any 429 max ms | lost |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for label, c in cells.items():
        solo, p90 = median(c.solo_p90), median(c.p90)
        ratio = p90 / solo if p90 is not None and solo else None
        steps = (p90 - solo) / step_ms if p90 is not None and solo is not None else None
        print(
            f"| {label} | {fmt(solo)} | {fmt(median(c.p50))} | {fmt(p90)} | {fmt(ratio, '.1f')} "
            f"| {fmt(steps, '.1f')} "
            f"| {c.hi_refused} | {fmt(median(c.share), '.2f')} "
            f"| {fmt(median(c.low_ok))}/{fmt(median(c.low_refused))} "
            f"| {fmt(max(c.low_refusal_max_ms, default=None))} "
            f"| {fmt(max(c.refusal_max_ms, default=None))} | {c.lost} |"
        )
    for label, c in cells.items():
        if c.reasons:
            print(f"{label} refusals: " + ", ".join(f"{k} x{n}" for k, n in c.reasons.items()))
        if c.no_retry_after:
            missing = ", ".join(f"{k} x{n}" for k, n in c.no_retry_after.items())
            print(f"{label} refusals without Retry-After: {missing}")
        if c.errors:
            print(f"{label} other errors: " + "; ".join(f"{k} x{n}" for k, n in c.errors.items()))
    for label, c in cells.items():
        solo, p90 = median(c.solo_p90), median(c.p90)
        slow = max(c.low_refusal_max_ms, default=0.0) >= REFUSAL_S * 1e3
        if within_steps:
            name = f"hi p90 - solo <= {STEPS_OVER_SOLO:g} steps"
            met = p90 is not None and solo is not None and p90 - solo <= STEPS_OVER_SOLO * step_ms
        else:
            name = f"hi p90 <= {SOLO_X:g}x solo"
            met = bool(p90 is not None and solo and p90 <= SOLO_X * solo)
        checks = {
            name: met,
            "hi never refused": c.hi_refused == 0,
            "low refused under saturation": any(c.low_refused),
            f"low refused < {REFUSAL_S:g} s": not slow,
            "lost 0": c.lost == 0,
        }
        print(f"{label}: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in checks.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--case", choices=("default", "chunked"), default="default")
    parser.add_argument("--engines", type=int, help="default: the case's")
    parser.add_argument("--speed", type=float, default=0.1, help="mock time compression")
    parser.add_argument(
        "--step-tokens", type=int, help="engines' max_num_batched_tokens (default: the case's)"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch-x", type=float, default=3.0, help="batch rate / capacity")
    parser.add_argument("--interactive-share", type=float, default=0.2)
    parser.add_argument("--sheddable-share", type=float, default=0.2)
    parser.add_argument(
        "--no-flow-off", action="store_true", help="skip the run with flow control off"
    )
    parser.add_argument(
        "--ours-args",
        default="",
        help="one more target: flow on with these flags too ('--flow-max-queued-prefill-tokens 1')",
    )
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines order their waiting queue by priority (vLLM's --scheduling-policy "
        "priority); give our router --flow-engine-priority with --ours-args",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rev", help="run our router from this git revision (a temporary worktree)"
    )
    args = parser.parse_args()
    case = CASES[args.case]
    args.engines = args.engines or case.engines
    args.step_tokens = args.step_tokens or case.step_tokens
    if args.case == "chunked":
        chunked(args, case.flood_prompt_tokens, case.quiet_turns, case.processes)
        return

    capacity = step_capacity(args.engines, args.speed, args.step_tokens)
    base = BandsParams(duration_s=args.duration)
    mean_prompt = sum(base.batch_prompt_tokens) / 2
    params = BandsParams(
        rate=capacity / mean_prompt,
        duration_s=args.duration,
        batch_x=args.batch_x,
        interactive_share=args.interactive_share,
        sheddable_share=args.sheddable_share,
    )
    flood = bands(args.seed, params)
    solo = bands(args.seed, BandsParams(**{**vars(params), "batch_x": 0.0, "sheddable_share": 0.0}))
    # With flow control off the engines hold the whole flood: it drains in batch_x
    # durations at capacity; a request unanswered after that, and a margin, is lost.
    timeout_s = (args.batch_x + 1.0) * args.duration + 60.0
    command = "python -m bench.priority " + shlex.join(sys.argv[1:])
    rate = params.rate
    header = (
        f"command: {command.strip()}\n"
        f"fleet: {args.engines} mock engines at speed {args.speed}, {args.step_tokens} tokens "
        f"a step; prefill capacity {capacity:,.0f} tokens/s (timing model) = {rate:.2f} batch "
        f"requests/s of {mean_prompt:.0f} tokens. batch at {args.batch_x}x "
        f"({args.batch_x * rate:.2f}/s), interactive at {args.interactive_share} of it "
        f"({args.interactive_share * rate:.2f}/s, {len(solo.requests)} requests), sheddable at "
        f"{args.sheddable_share} ({args.sheddable_share * rate:.2f}/s); one tenant; "
        f"{args.duration:.0f} s, {args.repeats} repeat(s), seed {args.seed}"
    )
    print(header, file=sys.stderr)
    with ExitStack() as stack:
        fleet = start_fleet(stack, args)
        specs = targets(args.step_tokens, not args.no_flow_off, args.ours_args)
        if args.rev:
            code = worktree(stack, args.rev)
            specs = [replace(s, label=f"{s.label} @{args.rev}", code=code) for s in specs]
        cells = run_all(fleet, specs, solo, flood, capacity, args.repeats, timeout_s)
    report(cells, header, 1e3 * args.step_tokens * args.engines / capacity)


def start_fleet(stack: ExitStack, args: argparse.Namespace) -> MockFleet:
    """The mock fleet of ``args``: its step budget, and priority scheduling when asked."""
    config = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yaml"))
    policy = "priority" if args.engine_priority else "fcfs"
    config.write(
        f"mock:\n  max_num_batched_tokens: {args.step_tokens}\n  scheduling_policy: {policy}\n"
    )
    config.flush()
    return stack.enter_context(
        MockFleet(args.engines, speed=args.speed, seed=args.seed,
                  extra_args=["--config", config.name])
    )  # fmt: skip


def chunked(
    args: argparse.Namespace,
    flood_prompt_tokens: tuple[int, int],
    quiet_turns: int,
    processes: int | None,
) -> None:
    """The two-tenant case on chunked-prefill engines: the flood sheddable, the quiet
    tenant's chats above the default band."""
    capacity = step_capacity(args.engines, args.speed, args.step_tokens)
    mean_prompt = sum(flood_prompt_tokens) / 2
    params = NoisyParams(
        rate=capacity / mean_prompt,
        duration_s=args.duration,
        flood_x=args.batch_x,
        quiet_share=args.interactive_share,
        flood_prompt_tokens=flood_prompt_tokens,
        quiet_turns=quiet_turns,
        flood_tenant=SHEDDABLE,
        quiet_tenant=INTERACTIVE,
    )
    flood = with_priorities(noisy(args.seed, params), params)
    solo = with_priorities(noisy(args.seed, replace(params, flood_x=0.0)), params)
    timeout_s = (args.batch_x + 1.0) * args.duration + 60.0
    keys = f"{params.flood_tenant}:{params.flood_key},{params.quiet_tenant}:{params.quiet_key}"
    on: tuple[str, ...] = (
        "--api-key", keys, "--flow-max-queued-prefill-tokens", str(args.step_tokens)
    )  # fmt: skip
    if args.engine_priority:
        on += ("--flow-engine-priority",)
    specs = [KeyedSpec(FLOW_ON, "switchyard", "kv_aware", processes=processes, extra=on)]
    if args.ours_args:
        more = (*on, *shlex.split(args.ours_args))
        label = f"{FLOW_ON} {args.ours_args}"
        specs.append(KeyedSpec(label, "switchyard", "kv_aware", processes=processes, extra=more))
    header = (
        f"command: python -m bench.priority {shlex.join(sys.argv[1:])}\n"
        f"fleet: {args.engines} mock engines at speed {args.speed}, {args.step_tokens} tokens "
        f"a step; prefill capacity {capacity:,.0f} tokens/s (timing model) = "
        f"{params.rate:.2f} flood requests/s of {mean_prompt:.0f} tokens. Flood "
        f"(x-priority -1, the low band) at {args.batch_x}x, quiet 4-turn chats (x-priority 1) "
        f"at {args.interactive_share} of it ({len(solo.requests)} requests); two tenants by "
        f"key; our router --processes {processes}; {args.duration:.0f} s, "
        f"{args.repeats} repeat(s), seed {args.seed}"
    )
    print(header, file=sys.stderr)
    with ExitStack() as stack:
        fleet = start_fleet(stack, args)
        if args.rev:
            code = worktree(stack, args.rev)
            specs = [replace(s, label=f"{s.label} @{args.rev}", code=code) for s in specs]
        cells = run_all(
            fleet, specs, solo, flood, capacity, args.repeats, timeout_s, params.flood_tenant
        )
    report(cells, header, 1e3 * args.step_tokens * args.engines / capacity, within_steps=True)


def run_all(
    fleet: MockFleet,
    specs: list[KeyedSpec],
    solo: Workload,
    flood: Workload,
    capacity: float,
    repeats: int,
    timeout_s: float,
    flood_tenant: str = BATCH,
) -> dict[str, Cell]:
    """Every target's solo and flood runs, ``repeats`` times in alternating order;
    ``flood_tenant``: the band whose answered tokens are the batch share."""
    cells = {s.label: Cell() for s in specs}
    for repeat in range(repeats):
        for spec in specs if repeat % 2 == 0 else list(reversed(specs)):
            began = time.perf_counter()
            runs = [
                Run(run_case(fleet, spec, w, timeout_s), capacity, flood_tenant, INTERACTIVE)
                for w in (solo, flood)
            ]
            cells[spec.label].add(*runs)
            r = runs[1]
            print(
                f"{spec.label} repeat {repeat + 1}: flood sent {len(r.results)}, "
                f"ok {sum(x.ok for x in r.results)}, refused {len(r.refused)}, lost {r.lost}; "
                f"{time.perf_counter() - began:.0f} s",
                file=sys.stderr,
            )
    return cells


if __name__ == "__main__":
    main()
