"""Router CPU a request on the fixed backend: this checkout against another commit (and smg).

``bench.overhead`` gives the req/s ratio to smg; this gives what a code change did to the
router's own cost, which that ratio hides in noise when the load generator, the backend
and the router share a few cores (its runs vary by several percent on one commit). Each
router runs its default command in
front of nginx; wrk loads them in rotating order, ``--rounds`` times, and each run's
router CPU (its processes', from /proc) is divided by the requests it answered.

    python -m bench.fixed_backend_cpu [--against REV] [--rounds 4] [--duration 6]
        [--connections 32] [--no-smg]

``--against`` (default ``HEAD``) is checked out into a temporary git worktree and run
with ``python -P`` so that it imports its own code, not this checkout's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.overhead import fixed_backend, process, router_argv, run_wrk, smg_router
from switchyard.loadtest.procs import Server, cpu_seconds, free_port, python_from
from tools.worktree import REPO, worktree


def router(code: Path, backend: str) -> Server:
    port = free_port()
    python, env = python_from(code)
    return process([*python, *router_argv(backend, port)[1:]], port, "/ready", env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="git revision to compare with")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=int, default=6)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--no-smg", action="store_true")
    args = ap.parse_args()
    for tool in ("wrk", "nginx", "git"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is required")
    smg = None if args.no_smg else shutil.which("smg")

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backend, lua = fixed_backend(stack, Path(tmp))
        servers = {
            "this checkout": stack.enter_context(router(REPO, backend)),
            args.against: stack.enter_context(router(worktree(stack, args.against), backend)),
        }
        if smg:
            servers["smg"] = stack.enter_context(smg_router(smg, backend))
        names = list(servers)
        runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                server = servers[name]
                assert server.proc is not None
                before = cpu_seconds(server.proc.pid)
                result = run_wrk(server.url, args.connections, args.duration, lua)
                used = cpu_seconds(server.proc.pid) - before
                runs[name].append((result.rps, used / max(result.requests, 1) * 1e3))
                print(
                    f"round {r + 1} {name}: {result.rps:,.0f} req/s, "
                    f"{runs[name][-1][1]:.3f} ms CPU a request",
                    flush=True,
                )
        print(f"\nmedians of {args.rounds} rounds, {args.connections} connections:")
        for name in names:
            rps = statistics.median(x[0] for x in runs[name])
            cpu = statistics.median(x[1] for x in runs[name])
            print(f"{name:>16}: {rps:8,.0f} req/s  {cpu:.3f} ms router CPU a request")


if __name__ == "__main__":
    main()
