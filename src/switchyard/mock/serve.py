"""Assemble engines, KV-event publishers and HTTP servers, and run them in one event loop.

Several uvicorn servers share one loop (a DP rank per port, or a whole fleet), so the
launcher owns signal handling and engine start/stop instead of uvicorn's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
import uvloop

from switchyard.mock.app import EngineServer
from switchyard.mock.bootstrap import BootstrapServer
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.driver import RealClockEngine
from switchyard.mock.faults import Faults
from switchyard.mock.kvevents import KVEventPublisher
from switchyard.mock.metrics import EngineMetrics
from switchyard.mock.pd import HeldKV, KVPuller
from switchyard.mock.settings import ENGINE_FIELDS, MockSettings
from switchyard.mock.tokenizer import ModelTokenizer

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


def engine_config(s: MockSettings) -> EngineConfig:
    given = {f: getattr(s, f) for f in ENGINE_FIELDS if getattr(s, f) is not None}
    if s.lora_enabled:
        given.update(max_loras=s.max_loras, lora_load_us=s.lora_load_ms * 1000.0)
    return EngineConfig(speed=s.speed, seed=s.seed, hash_flavor=s.flavor, **given)


def faults_from(s: MockSettings) -> Faults:
    return Faults(
        error_rate=s.fault_error_rate,
        error_codes=list(s.fault_error_codes),
        latency_rate=s.fault_latency_rate,
        latency_ms=s.fault_latency_ms,
        hang_rate=s.fault_hang_rate,
        crash_after=s.fault_crash_after,
        slow_stream_ms=s.fault_slow_stream_ms,
        drop_after_tokens=s.fault_drop_after_tokens,
        drop_rate=s.fault_drop_rate,
        seed=s.seed,
    )


def bootstrap_port(s: MockSettings) -> int | None:
    """SGLang prefill engines serve a bootstrap port (SGLang's default is 8998)."""
    if s.flavor != "sglang" or s.role != "prefill":
        return None
    return s.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT


@dataclass
class Endpoint:
    """One HTTP port of the mock: its app and the ranks behind it."""

    port: int
    ranks: list[int]
    app: Any
    engines: list[RealClockEngine] = field(default_factory=list)


@dataclass
class Deployment:
    """Everything one ``MockSettings`` runs: HTTP endpoints, bootstrap server, publishers."""

    settings: MockSettings
    endpoints: list[Endpoint]
    publishers: list[Any]
    puller: KVPuller

    def describe(self) -> dict[str, Any]:
        return describe(self.settings)


def rank_groups(s: MockSettings) -> list[list[int]]:
    """DP ranks per HTTP port: all behind one port, or one port per rank (external LB)."""
    return [[r] for r in range(s.dp_size)] if s.dp_external else [list(range(s.dp_size))]


def describe(s: MockSettings) -> dict[str, Any]:
    """Where one mock engine serves what (ports follow from the settings alone)."""
    host = s.host
    events = []
    if s.kv_events_port is not None:
        events = [
            {
                "dp_rank": r,
                "endpoint": f"tcp://{host}:{s.kv_events_port + r}",
                "replay_endpoint": f"tcp://{host}:{s.kv_events_replay_port + r}"
                if s.kv_events_replay_port is not None
                else None,
                "topic": s.kv_events_topic,
                "encoding": s.kv_events_encoding,
            }
            for r in range(s.dp_size)
        ]
    boot = bootstrap_port(s)
    return {
        "model": s.model,
        "flavor": s.flavor,
        "role": s.role,
        "engine_id": s.engine_id,
        "dp_size": s.dp_size,
        "dp_external": s.dp_external,
        "block_size": engine_config(s).block_size,
        "urls": [
            {"url": f"http://{host}:{s.port + i}", "dp_ranks": ranks}
            for i, ranks in enumerate(rank_groups(s))
        ],
        "bootstrap": {"host": host, "port": boot} if boot else None,
        "kv_events": events,
    }


def _publisher_factory(s: MockSettings) -> Callable[[int], Any] | None:
    if s.kv_events_port is None:
        return None

    def make(rank: int) -> Any:
        replay = (
            f"tcp://{s.host}:{s.kv_events_replay_port}"
            if s.kv_events_replay_port is not None
            else None
        )
        return KVEventPublisher(
            f"tcp://{s.host}:{s.kv_events_port}",
            replay_endpoint=replay,
            topic=s.kv_events_topic,
            encoding=s.kv_events_encoding,
            dp_rank=rank,
        )

    return make


def build(s: MockSettings, tokenizer: ModelTokenizer | None = None) -> Deployment:
    """Create (not start) the engines, publishers and apps that ``s`` describes."""
    tok = tokenizer or ModelTokenizer(s.tokenizer)
    config = engine_config(s)
    make_publisher = _publisher_factory(s)
    publishers = [make_publisher(r) for r in range(s.dp_size)] if make_publisher else []
    engines = [
        RealClockEngine(config, r, publishers[r].publish if publishers else None)
        for r in range(s.dp_size)
    ]
    faults = faults_from(s)
    held = HeldKV(config.held_kv_timeout_s / max(config.speed, 1e-9) + 5.0)
    puller = KVPuller()

    def inject_gap(n: int) -> None:
        for p in publishers:
            p.inject_gap(n)

    def drop_events(n: int) -> None:
        for p in publishers:
            p.drop_next(n)

    endpoints: list[Endpoint] = []
    for i, ranks in enumerate(rank_groups(s)):
        port = s.port + i
        metrics = EngineMetrics(
            s.flavor,
            s.model,
            ranks,
            s.role,
            s.dp_size,
            config.block_size,
            config.enable_prefix_caching,
            config.max_loras if s.flavor == "vllm" else 0,
        )
        app = EngineServer(
            s,
            {r: engines[r] for r in ranks},
            tok,
            faults,
            held,
            puller,
            metrics,
            port,
            inject_gap,
            drop_events,
        )
        endpoints.append(Endpoint(port, ranks, app, [engines[r] for r in ranks]))
    boot = bootstrap_port(s)
    if boot is not None:
        endpoints.append(Endpoint(boot, [], BootstrapServer(endpoints[0].app)))
    if s.fault_kv_gap:
        inject_gap(s.fault_kv_gap)
    return Deployment(s, endpoints, publishers, puller)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the launcher (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        """Tick once a second, not uvicorn's ten times: the tick only refreshes the Date
        header each second and checks ``should_exit``, and a fleet runs hundreds of servers."""
        while not await self.on_tick(0):
            await asyncio.sleep(1.0)


async def run(deployments: list[Deployment], on_ready: Callable[[], None] | None = None) -> None:
    """Start engines and servers; run until SIGINT/SIGTERM; stop everything."""
    servers: list[_Server] = []
    for d in deployments:
        for e in d.endpoints:
            config = uvicorn.Config(
                e.app,
                host=d.settings.host,
                port=e.port,
                http="httptools",
                loop="none",
                lifespan="off",
                access_log=False,
                log_level="warning",
                backlog=4096,
                timeout_keep_alive=30,
            )
            servers.append(_Server(config))
    engines = [eng for d in deployments for e in d.endpoints for eng in e.engines]
    for eng in engines:
        await eng.start()
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for srv in servers:
            srv.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    tasks = [asyncio.ensure_future(srv.serve()) for srv in servers]
    try:
        while not all(srv.started for srv in servers):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        if on_ready is not None and all(srv.started for srv in servers):
            on_ready()
        await asyncio.gather(*tasks)
    finally:
        stop()
        for eng in engines:
            await eng.stop()
        for d in deployments:
            await d.puller.close()
            for p in d.publishers:
                p.close()


def run_blocking(deployments: list[Deployment], on_ready: Callable[[], None] | None = None) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run(deployments, on_ready))
