"""Tenant rate limits across processes: a tenant offered twice its tokens per minute is
served its limit, whether its requests reach two processes of one router or two router
replicas.

One tenant sends open-loop Poisson chats (prompts of ``--prompt-tokens`` words, ``--max-
tokens`` each) at ``--offered-x`` times its ``flow.tenant_tokens_per_minute`` through a mock
fleet fast enough that only the limiter refuses. Two cases, run side by side by default
(each has its own routers and the load is light; ``--serial`` runs them one after the
other):

  bus     one ``switchyard router --processes 2``: its processes share the limit over the
          sibling bus. Every request closes its connection, so the kernel hands each to
          either process (their CPU seconds are printed to show both served).
  redis   two routers on their own ports sharing a private ``redis-server``
          (``--redis-url``); the client alternates between them.
  apart   the control: two routers that share nothing, the client alternating between
          them; each admits the limit, so twice the limit is served.

The bucket starts full, so the first minute admits up to twice the limit (the full bucket
plus its refill); the target, within 10 % of the limit, applies to the steady window after
``--warmup-s``. Admitted tokens are the prompt and output tokens of the answered requests
(the engine's usage), binned by send time.

Printed per case:
  whole         admitted tokens a minute over the whole run, and over the limit (a bucket
                that starts full allows (1 + 1/minutes) times the limit here)
  steady        the same over the steady window; target within 10 % of the limit
  per minute    admitted tokens in each minute of the run, over the limit
  refused       429 answers; rate_limited with Retry-After / all of them
  lost          sent - answered - refused; must be 0

Run:  python -m bench.ratelimit [--minutes 3] [--warmup-s 60] [--tpm 60000] [--offered-x 2]
                                [--cases bus,redis,apart] [--serial] [--speed 1] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.fleet import Engine, MockFleet
from switchyard.loadtest.procs import cpu_seconds, descendants, redis_server
from switchyard.loadtest.routers import RouterSpec, RunningRouter, start_router
from switchyard.loadtest.text import default_bank
from switchyard.loadtest.workload import Request, Workload

MODEL = "mock-model"
TENANT, KEY = "A", "ratelimit-a-key"
REASON = "rate_limited"
CASES = ("bus", "redis", "apart")
CONTROL = "apart"  # shares nothing: shows the bench would see a limit admitted twice
TARGET = 0.10  # steady admitted tokens within this share of the limit


@dataclass(frozen=True)
class LimitedSpec(RouterSpec):
    """Our router with the tenant's key, its tokens-per-minute limit and flags of its own."""

    tpm: int = 0
    extra: tuple[str, ...] = ()

    def command(self, engines: list[Engine], port: int, tokenizer: str) -> list[str]:
        keys = ("--api-key", f"{TENANT}:{KEY}")
        return [*super().command(engines, port, tokenizer), *keys, *self.extra]

    def environ(self) -> dict[str, str]:
        env = super().environ()
        limits = orjson.dumps({TENANT: self.tpm}).decode()
        env["SWITCHYARD_ROUTER_FLOW__TENANT_TOKENS_PER_MINUTE"] = limits
        return env


def workload(
    seed: int, rate: float, duration_s: float, prompt: tuple[int, int], max_tokens: int
) -> Workload:
    """The tenant's requests: Poisson arrivals at ``rate`` a second for ``duration_s``, each
    closing its connection (a new one lands on either process of a router)."""
    rng = random.Random(f"ratelimit:{seed}")
    bank = default_bank()
    requests: list[Request] = []
    t = 0.0
    while t < duration_s:
        text = bank.text(f"ratelimit:{seed}:{len(requests)}", rng.randint(*prompt))
        messages = [{"role": "user", "content": text}]
        headers = (("connection", "close"),)
        i = len(requests)
        requests.append(Request(i, t, messages, max_tokens, f"{TENANT}:{i}", TENANT, KEY, headers))
        t += rng.expovariate(rate)
    params = {"rate": rate, "duration_s": duration_s, "prompt": prompt, "max_tokens": max_tokens}
    return Workload("ratelimit", seed, requests, params)


@dataclass
class Case:
    """What one case measured."""

    name: str
    routers: str
    results: list[Result]
    duration_s: float
    warmup_s: float
    tpm: int
    cpu_s: list[float] = field(default_factory=list)  # per router process

    def admitted(self, start: float, end: float) -> int:
        return sum(
            r.prompt_tokens + r.output_tokens
            for r in self.results
            if r.ok and start <= r.sent_s < end
        )

    def per_minute(self, start: float, end: float) -> float:
        return self.admitted(start, end) * 60.0 / (end - start)

    @property
    def whole(self) -> float:
        return self.per_minute(0.0, self.duration_s)

    @property
    def steady(self) -> float:
        return self.per_minute(self.warmup_s, self.duration_s)

    @property
    def minutes(self) -> list[float]:
        edges = [*range(0, int(self.duration_s), 60), self.duration_s]
        return [self.per_minute(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]

    @property
    def refused(self) -> list[Result]:
        return [r for r in self.results if r.status == 429]

    @property
    def refused_ok(self) -> int:
        """Refusals that say why (rate_limited) and when to come back (Retry-After)."""
        return sum(1 for r in self.refused if r.reason == REASON and r.retry_after)

    @property
    def lost(self) -> int:
        return len(self.results) - sum(1 for r in self.results if r.ok) - len(self.refused)

    @property
    def held(self) -> bool:
        return abs(self.steady / self.tpm - 1.0) <= TARGET


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def router_cpu(routers: list[RunningRouter]) -> list[float]:
    """CPU seconds of each router process (the supervisor of ``--processes`` excluded)."""
    out = []
    for router in routers:
        pids = sorted(descendants(router.proc.pid))
        workers = [p for p in pids if b"spawn_main" in _cmdline(p)] or [router.proc.pid]
        for pid in workers:
            try:
                out.append(cpu_seconds(pid))
            except OSError:
                continue
    return out


def case_routers(
    name: str, fleet: MockFleet, tpm: int, policy: str, stack: ExitStack
) -> tuple[str, list[RunningRouter]]:
    """The routers of case ``name``, started within ``stack``, and how to describe them."""
    if name == "bus":
        spec = LimitedSpec("bus", "switchyard", policy, processes=2, tpm=tpm)
        return "1 router, --processes 2", [stack.enter_context(start_router(spec, fleet.engines))]
    if name == CONTROL:
        spec = LimitedSpec(name, "switchyard", policy, processes=1, tpm=tpm)
        described = "2 routers sharing nothing"
    else:
        url, _ = stack.enter_context(redis_server())
        spec = LimitedSpec(name, "switchyard", policy, processes=1, tpm=tpm,
                           extra=("--redis-url", url))  # fmt: skip
        described = "2 routers, --redis-url"
    return described, [stack.enter_context(start_router(spec, fleet.engines)) for _ in range(2)]


async def drive(routers: list[RunningRouter], w: Workload, timeout_s: float) -> list[Result]:
    """Replay ``w`` through ``routers``, request i to router i mod n (results in send order)."""
    n = len(routers)
    parts = [
        Workload(w.name, w.seed, [r for r in w.requests if r.index % n == k], w.params)
        for k in range(n)
    ]
    runs = await asyncio.gather(
        *(
            replay(router.url, part, MODEL, timeout_s)
            for router, part in zip(routers, parts, strict=True)
        )
    )
    return sorted((r for run in runs for r in run), key=lambda r: r.sent_s)


async def run_cases(
    cases: list[tuple[str, str, list[RunningRouter]]], w: Workload, serial: bool, timeout_s: float
) -> list[list[Result]]:
    if serial:
        return [await drive(routers, w, timeout_s) for _, _, routers in cases]
    return list(await asyncio.gather(*(drive(rs, w, timeout_s) for _, _, rs in cases)))


def fmt_x(value: float, tpm: int) -> str:
    return f"{value:,.0f} ({value / tpm:.2f}x)"


def report(cases: list[Case], header: str) -> None:
    print(header)
    head = (
        "| case | routers | whole tok/min | steady tok/min | per minute (x limit) "
        "| refused (rate_limited + RA / all) | lost | router CPU s |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for c in cases:
        minutes = " / ".join(f"{m / c.tpm:.2f}" for m in c.minutes)
        cpu = " / ".join(f"{s:.0f}" for s in c.cpu_s)
        print(
            f"| {c.name} | {c.routers} | {fmt_x(c.whole, c.tpm)} | {fmt_x(c.steady, c.tpm)} "
            f"| {minutes} | {c.refused_ok}/{len(c.refused)} | {c.lost} | {cpu} |"
        )
    for c in cases:
        others = Counter(r.error[:80] for r in c.results if not r.ok and r.status != 429)
        if others:
            print(f"{c.name} other errors: " + "; ".join(f"{k} x{n}" for k, n in others.items()))
        checks = {
            f"steady within {TARGET:.0%} of the limit": c.held,
            "every refusal rate_limited with Retry-After": c.refused_ok == len(c.refused),
            "lost 0": c.lost == 0,
        }
        if c.name == CONTROL:  # the limit is held per router: twice it in all
            checks = {"steady about twice the limit": abs(c.steady / c.tpm - 2.0) <= 2 * TARGET,
                      "lost 0": c.lost == 0}  # fmt: skip
        print(f"{c.name}: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in checks.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="length of the run")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="the burst before the window")
    parser.add_argument("--tpm", type=int, default=60_000, help="the tenant's tokens per minute")
    parser.add_argument("--offered-x", type=float, default=2.0, help="offered tokens / limit")
    parser.add_argument("--prompt-tokens", default="200,600", help="prompt length range, words")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cases", default=",".join(CASES), help="some of bus, redis, apart")
    parser.add_argument("--serial", action="store_true", help="one case after the other")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--speed", type=float, default=1.0, help="mock time compression")
    parser.add_argument("--policy", default="kv_aware")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    if not names or any(n not in CASES for n in names):
        parser.error(f"--cases: some of {', '.join(CASES)}")
    duration_s = args.minutes * 60.0
    if duration_s - args.warmup_s < 120.0:
        print("note: the steady window is shorter than 2 minutes", file=sys.stderr)
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    mean_tokens = (lo + hi) / 2 + args.max_tokens
    rate = args.offered_x * args.tpm / 60.0 / mean_tokens
    w = workload(args.seed, rate, duration_s, (lo, hi), args.max_tokens)
    command = "python -m bench.ratelimit " + shlex.join(sys.argv[1:])
    header = (
        f"command: {command.strip()}\n"
        f"tenant limit {args.tpm:,} tokens/min; offered {args.offered_x}x "
        f"({rate:.2f} requests/s of ~{mean_tokens:.0f} tokens, {len(w.requests)} requests "
        f"over {duration_s:.0f} s); steady window {args.warmup_s:.0f}-{duration_s:.0f} s; "
        f"{args.engines} mock engines at speed {args.speed}; "
        f"{'one case after the other' if args.serial else 'cases side by side'}"
    )
    print(header, file=sys.stderr)
    timeout_s = 120.0
    with ExitStack() as stack:
        fleet = stack.enter_context(MockFleet(args.engines, speed=args.speed, seed=args.seed))
        started = []
        for name in names:
            described, routers = case_routers(name, fleet, args.tpm, args.policy, stack)
            started.append((name, described, routers))
        time.sleep(1.0)  # every router's first probe and scrape of the engines
        cpu0 = {name: router_cpu(routers) for name, _, routers in started}
        began = time.perf_counter()
        results = asyncio.run(run_cases(started, w, args.serial, timeout_s))
        print(f"replayed in {time.perf_counter() - began:.0f} s", file=sys.stderr)
        cases = []
        for (name, described, routers), res in zip(started, results, strict=True):
            cpu = [b - a for a, b in zip(cpu0[name], router_cpu(routers), strict=False)]
            cases.append(Case(name, described, res, duration_s, args.warmup_s, args.tpm, cpu))
    report(cases, header)


if __name__ == "__main__":
    main()
