"""Router CPU a request on the fixed backend: this checkout against another commit (and smg).

``bench.overhead`` gives the req/s ratio to smg; this gives what a code change did to the
router's own cost, which that ratio hides in noise when the load generator, the backend
and the router share a few cores (its runs vary by several percent on one commit). Each
router runs its default command in
front of nginx; wrk loads them in rotating order, ``--rounds`` times, and each run's
router CPU (its processes', from /proc) is divided by the requests it answered.

    python -m bench.fixed_backend_cpu [--against REV] [--rounds 4] [--duration 6]
        [--connections 32] [--no-smg] [--instructions] [--router-args "..."]
        [--against-args "..."]

``--against`` (default ``HEAD``) is checked out into a temporary git worktree and run
with ``python -P`` so that it imports its own code, not this checkout's.

``--instructions`` counts instructions instead, which the machine's other load does not
move where CPU time varies by several percent from run to run: each router runs as one
process (``--processes 1``) under ``valgrind --tool=callgrind``; after ``WARM_UP``
requests the counters are zeroed, ``COUNTED`` requests follow over ``COUNT_CONNECTIONS``
keep-alive connections, and the count is dumped. The event loop's batching moves the
figure by about 1 % from run to run. ``--router-args`` are added to both routers'
command lines, ``--against-args`` to the compared one's only: ``--against HEAD
--against-args=--no-flow-enabled`` gives what flow control costs, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.overhead import BODY, fixed_backend, process, router_argv, run_wrk, smg_router
from switchyard.loadtest.procs import Server, cpu_seconds, free_port, python_from
from tools.worktree import REPO, worktree

WARM_UP = 400
COUNTED = 3000
COUNT_CONNECTIONS = 8
START_TIMEOUT_S = 900  # a router's imports under valgrind take minutes


def router(code: Path, backend: str, extra: list[str]) -> Server:
    port = free_port()
    python, env = python_from(code)
    return process([*python, *router_argv(backend, port, *extra)[1:]], port, "/ready", env=env)


async def _post(port: int, requests: int) -> None:
    """``requests`` completions, one after another on one keep-alive connection."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(requests):
            writer.write(head)
            answer = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", answer)
            if not answer.startswith(b"HTTP/1.1 200") or length is None:
                raise SystemExit(f"the router answered {answer[:200]!r}")
            await reader.readexactly(int(length[1]))
    finally:
        writer.close()


def _load(port: int, requests: int) -> None:
    each = requests // COUNT_CONNECTIONS

    async def run() -> None:
        await asyncio.gather(*(_post(port, each) for _ in range(COUNT_CONNECTIONS)))

    asyncio.run(run())


def instructions(code: Path, backend: str, extra: list[str], out: Path) -> float:
    """Instructions a request of the router imported from ``code``, counted by callgrind."""
    port = free_port()
    python, env = python_from(code)
    argv = [*python, *router_argv(backend, port, "--processes", "1", *extra)[1:]]
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    server = process(
        [*valgrind, *argv], port, "/ready", env, start_timeout_s=START_TIMEOUT_S, stop_timeout_s=60
    )
    with server:
        assert server.proc is not None
        pid = str(server.proc.pid)
        _load(port, WARM_UP)
        subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
        _load(port, COUNTED)
        subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)
    dump = Path(f"{out}.1")  # the first dump; the file without a suffix is the exit's
    totals = re.search(r"^totals:\s*(\d+)", dump.read_text(errors="replace"), re.M)
    if totals is None:
        raise SystemExit(f"no totals in {dump}")
    return int(totals[1]) / (COUNT_CONNECTIONS * (COUNTED // COUNT_CONNECTIONS))


def count_instructions(args: argparse.Namespace, extra: dict[str, list[str]]) -> None:
    """Each router under callgrind, one after the other (``--rounds`` times, alternating)."""
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is required for --instructions")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backend, _ = fixed_backend(stack, Path(tmp))
        codes = {"this checkout": REPO, args.against: worktree(stack, args.against)}
        names = list(codes)
        counts: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for i, name in enumerate(names[r % 2 :] + names[: r % 2]):
                out = Path(tmp) / f"callgrind-{r}-{i}.out"
                counts[name].append(instructions(codes[name], backend, extra[name], out))
                print(f"round {r + 1} {name}: {counts[name][-1] / 1e3:,.0f}k", flush=True)
        print(f"\ninstructions a request, medians of {args.rounds} rounds:")
        for name in names:
            print(f"{name:>16}: {statistics.median(counts[name]) / 1e3:,.0f}k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="git revision to compare with")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=int, default=6)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--no-smg", action="store_true")
    ap.add_argument("--instructions", action="store_true", help="count them under callgrind")
    ap.add_argument("--router-args", default="", help="added to both routers' commands")
    ap.add_argument("--against-args", default="", help="added to the compared router's only")
    args = ap.parse_args()
    both = shlex.split(args.router_args)
    extra = {"this checkout": both, args.against: [*both, *shlex.split(args.against_args)]}
    if args.instructions:
        count_instructions(args, extra)
        return
    for tool in ("wrk", "nginx", "git"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is required")
    smg = None if args.no_smg else shutil.which("smg")

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backend, lua = fixed_backend(stack, Path(tmp))
        servers = {
            "this checkout": stack.enter_context(router(REPO, backend, extra["this checkout"])),
            args.against: stack.enter_context(
                router(worktree(stack, args.against), backend, extra[args.against])
            ),
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
