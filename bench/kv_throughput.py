"""KV-aware routing of multi-turn chats at the highest rate one router sustains.

The target is 1,000 req/s of KV-aware routing of long multi-turn chats through one
router. ``bench.router_cpu`` replays chats at their arrival times; this
one sends them as fast as the router answers: wrk (C, from Debian) posts the multi-turn
workload's chat bodies in their order, as non-streamed requests for a few tokens, to
mock engines at high speed, with ``--connections`` open at once. It prints req/s, the
router's CPU per request and the mock fleet's, per router, alternating, several rounds.

    python -m bench.kv_throughput --duration 8 --rounds 3

Everything shares the machine's cores: the router, the mock engines (which tokenize
every prompt, as an engine does) and wrk. The router's CPU per request is the figure that
carries to a machine with a core per part: one core at P ms a request routes 1,000/P
requests a second.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.compare_routing import SCENARIOS
from bench.overhead import run_wrk
from bench.router_cpu import workload_for
from switchyard.loadtest.compare import MODEL, run_order
from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.procs import cpu_seconds
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router
from switchyard.mock.settings import DEFAULT_TOKENIZER

ROUTERS = ("kv_aware@1", "kv_aware@2", "smg:cache_aware")
THREADS = 2  # as bench.overhead.run_wrk runs wrk at 2 connections or more
CHAT = "/v1/chat/completions"

# Thread k of wrk sends bodies start + k, start + k + THREADS, ... of the file, then wraps.
LUA = """
local bodies = {}
for line in io.lines("%(path)s") do bodies[#bodies + 1] = line end
local headers = {["Content-Type"] = "application/json"}
local next_index = 0
local count = 0
function setup(thread)
  thread:set("first", %(start)d + count)
  count = count + 1
end
function init(args)
  next_index = first
end
function request()
  local body = bodies[next_index %% #bodies + 1]
  next_index = next_index + %(threads)d
  return wrk.format("POST", nil, headers, body)
end
"""


@dataclass
class Row:
    router: str
    round: int
    rps: float
    requests: int
    errors: int
    router_ms: float  # router CPU per request
    fleet_ms: float  # mock fleet CPU per request
    bodies_used: int = 0  # warm-up and measured requests: past the file's end, turns repeat

    def line(self) -> str:
        return (
            f"{self.router:>16} {self.round + 1:>5} {self.rps:>9,.0f} {self.requests:>8} "
            f"{self.errors:>6} {self.router_ms:>10.3f} {self.fleet_ms:>9.3f}"
        )


def write_bodies(path: Path, requests: int, max_tokens: int, seed: int) -> int:
    """The multi-turn workload's chat bodies, one JSON a line, non-streamed."""
    workload = workload_for("multiturn", requests, seed)
    with path.open("wb") as out:
        for req in workload.requests:
            body = {"model": MODEL, "messages": req.messages, "max_tokens": max_tokens}
            out.write(orjson.dumps(body) + b"\n")
    return len(workload.requests)


def lua_script(directory: Path, bodies: Path, start: int) -> Path:
    """wrk's script posting the bodies from the ``start``-th on."""
    path = directory / f"chats-{start}.lua"
    path.write_text(LUA % {"path": bodies, "threads": THREADS, "start": start})
    return path


def one_run(
    fleet: MockFleet, spec: RouterSpec, bodies: Path, args: argparse.Namespace, round_: int
) -> Row:
    fleet.reset()
    assert fleet.proc is not None
    with start_router(spec, fleet.engines, DEFAULT_TOKENIZER) as router:
        # A first pass warms what a long-running router has warm (connections, caches); the
        # measured run goes on from the next body, so that it repeats none of those turns.
        warm = run_wrk(router.url, args.connections, 2, lua_script(bodies.parent, bodies, 0), CHAT)
        lua = lua_script(bodies.parent, bodies, warm.requests)
        fleet_before = cpu_seconds(fleet.proc.pid)
        before = cpu_seconds(router.proc.pid)
        wrk = run_wrk(router.url, args.connections, args.duration, lua, CHAT)
        router_cpu = cpu_seconds(router.proc.pid) - before
        fleet_cpu = cpu_seconds(fleet.proc.pid) - fleet_before
    done = max(wrk.requests, 1)
    return Row(
        spec.label,
        round_,
        wrk.rps,
        wrk.requests,
        wrk.errors,
        router_cpu / done * 1e3,
        fleet_cpu / done * 1e3,
        warm.requests + wrk.requests,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_throughput", description=__doc__)
    ap.add_argument("--duration", type=int, default=8, help="seconds measured per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS))
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--speed", type=float, default=1000.0, help="mock engine speed-up")
    ap.add_argument("--requests", type=int, default=6000, help="chat bodies before wrapping")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is required: apt-get install -y wrk", file=sys.stderr)
        return 2
    specs = [RouterSpec.parse(r) for r in args.routers]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        count = write_bodies(bodies, args.requests, args.max_tokens, args.seed)
        blocks = int(SCENARIOS["multiturn"]["blocks"])
        print(f"{count} multi-turn chat bodies, {args.connections} connections, wrk")
        header = (
            f"{'router':>16} {'round':>5} {'req/s':>9} {'requests':>8} {'errors':>6} "
            f"{'router_ms':>10} {'fleet_ms':>9}"
        )
        print(header)
        with MockFleet(args.engines, blocks, args.speed, args.seed) as fleet:
            for round_ in range(args.rounds):
                for spec in run_order(specs, round_):
                    try:
                        row = one_run(fleet, spec, bodies, args, round_)
                    except Unavailable as exc:
                        print(f"{spec.label}: not available ({exc})", file=sys.stderr)
                        continue
                    rows.append(row)
                    print(row.line(), flush=True)
    print("\nmedians (router_ms, fleet_ms: CPU milliseconds per request):")
    print(header)
    for spec in specs:
        mine = [r for r in rows if r.router == spec.label]
        if mine:
            rps = statistics.median(r.rps for r in mine)
            print(
                f"{spec.label:>16} {'-':>5} {rps:>9,.0f} "
                f"{statistics.median(r.requests for r in mine):>8.0f} "
                f"{sum(r.errors for r in mine):>6} "
                f"{statistics.median(r.router_ms for r in mine):>10.3f} "
                f"{statistics.median(r.fleet_ms for r in mine):>9.3f}"
            )
    wrapped = any(r.bodies_used > count for r in rows)
    if wrapped:
        print(f"(runs wrapped past the {count} bodies: later turns were repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
