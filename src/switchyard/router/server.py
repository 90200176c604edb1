"""Assemble the router from its settings and run it under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.supervisors.multiprocess import Multiprocess

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.k8s import missing_client
from switchyard.balancer.remote import RemoteFleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.siblings import SiblingBus, SiblingShare
from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import WorkerSpec
from switchyard.core.version import version
from switchyard.kvstore.build import store_from_settings
from switchyard.kvstore.remote import RemoteKVStore
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from switchyard.router.app import RouterApp
from switchyard.router.connections import ClientConnection, ConnectionLimits
from switchyard.router.mainloop import install, request_exit
from switchyard.router.metrics import METRICS_DIR_ENV, write_metrics_behind
from switchyard.router.scheduler.framework import Scheduler
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.settings import RouterSettings
from switchyard.router.tracing import JsonFormatter
from switchyard.router.tracing import check as check_tracing


def worker_specs(settings: RouterSettings) -> list[WorkerSpec]:
    """Workers from flags/YAML, with the KV-event endpoints ``--kv-events`` assigns them."""
    specs = [WorkerSpec.parse(w) for w in settings.workers] + settings.pd.worker_specs()
    by_url = {spec.url: spec for spec in specs}
    for item in settings.kv.events:
        url, sep, endpoint = item.partition("=")
        if not sep or not endpoint.startswith("tcp://"):
            raise ValueError(f"--kv-events wants WORKER_URL=tcp://HOST:PORT, not {item!r}")
        spec = by_url.get(WorkerSpec(url=url).url)
        if spec is None:
            raise ValueError(f"--kv-events names {url}, which is not a --worker")
        spec.kv_events = endpoint
    return specs


def build_fleet(
    settings: RouterSettings, config_file: str | Path | None, siblings: SiblingBus | None = None
) -> FleetView:
    """The embedded fleet shares with ``siblings``; a balancer service is shared already."""
    balancer = BalancerSettings.load(config_file, redis_url=settings.redis_url)
    if settings.balancer != "embedded":
        remote = RemoteFleet(
            settings.balancer, api_key=settings.balancer_api_key, settings=balancer
        )
        for spec in worker_specs(settings):
            remote.add(spec)
        return remote
    fleet = Fleet(balancer, specs=worker_specs(settings), ssl_context=settings.tls.context())
    if siblings is not None:
        fleet.share_with_siblings(SiblingShare(fleet, siblings))
    return fleet


def build_kvstore(
    settings: RouterSettings, config_file: str | Path | None, wanted: bool
) -> KVStore | RemoteKVStore | None:
    """The KV store when the policy uses prefixes or the config points at one."""
    if settings.kvstore != "embedded":
        return RemoteKVStore(
            settings.kvstore, block_size=settings.kv.block_size, api_key=settings.kvstore_api_key
        )
    if not (wanted or settings.tokenizer or settings.kv.events):
        return None
    kv = KVStoreSettings.load(
        config_file,
        redis_url=settings.redis_url,
        tokenizer=settings.tokenizer,
        block_size=settings.kv.block_size,
        speculative_ttl_s=settings.kv.speculative_ttl_s,
        kv_listen=settings.kv.listen,
        events_max_frame_bytes=settings.kv.events_max_frame_bytes,
        events_heartbeat_s=settings.kv.events_heartbeat_s,
        events_heartbeat_timeout_s=settings.kv.events_heartbeat_timeout_s,
    )
    return store_from_settings(kv)


def build_app(
    settings: RouterSettings,
    config_file: str | Path | None = None,
    siblings: SiblingBus | None = None,
) -> RouterApp:
    """``siblings``: the bus to the other processes of this router, if it runs several."""
    scheduler = build_scheduler(
        settings.policy, settings.policy_options, block_size=settings.kv.block_size
    )
    per_model = model_schedulers(settings)
    fleet = build_fleet(settings, config_file, siblings)
    needs_prefix = scheduler.needs_prefix or any(s.needs_prefix for s in per_model.values())
    kvstore = build_kvstore(settings, config_file, needs_prefix)
    return RouterApp(
        settings, fleet, scheduler, kvstore, siblings=siblings, model_schedulers=per_model
    )


def model_schedulers(settings: RouterSettings) -> dict[str, Scheduler]:
    """The schedulers of the models with a policy of their own (``model_policies``)."""
    out = {}
    for model, policy in settings.policies.items():
        try:
            out[model] = build_scheduler(
                policy, settings.policy_options, block_size=settings.kv.block_size
            )
        except ValueError as exc:
            raise ValueError(f"--model-policy {model}={policy}: {exc}") from None
    return out


def preflight(settings: RouterSettings, config_file: str | Path | None = None) -> None:
    """Raise ``ValueError`` (one line) for what would stop start-up, before anything binds.

    The policies of every pool, the worker specs and their ``--kv-events``, an embedded
    balancer's Kubernetes discovery without its client, and a tracing exporter that could
    never send (``tracing.check``).
    """
    check_tracing(settings.tracing)
    if settings.balancer == "embedded":
        balancer = BalancerSettings.load(config_file, redis_url=settings.redis_url)
        if balancer.kubernetes and (missing := missing_client()) is not None:
            raise ValueError(missing)
    build_scheduler(settings.policy, settings.policy_options, block_size=settings.kv.block_size)
    model_schedulers(settings)
    pd = settings.pd
    pools = {"prefill": pd.prefill_policy, "decode": pd.decode_policy, "encode": pd.encode_policy}
    for pool, policy in pools.items():
        if policy is not None:
            try:
                build_scheduler(
                    policy, pd.policy_options.get(pool), block_size=settings.kv.block_size
                )
            except ValueError as exc:
                raise ValueError(f"pd.{pool}_policy: {exc}") from None
    worker_specs(settings)


def startup_summary(settings: RouterSettings) -> list[str]:
    """What a user needs to see when the router starts: where, who, how it routes and shares."""
    specs = worker_specs(settings)
    # A flavour not given in the spec is learned from the worker's first /metrics scrape.
    kinds = Counter(" ".join(filter(None, (spec.flavor, spec.role.value))) for spec in specs)
    fleet = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "none yet"
    if settings.balancer != "embedded":
        fleet += f"; balancer service {settings.balancer}"
    scheduler = build_scheduler(
        settings.policy, settings.policy_options, block_size=settings.kv.block_size
    )
    with_events = sum(1 for spec in specs if spec.kv_events)
    if settings.kvstore != "embedded":
        kv = f"kvstore service {settings.kvstore}"
    elif not (scheduler.needs_prefix or settings.tokenizer or settings.kv.events):
        kv = "off (the policy uses no prefixes)"
    elif with_events == len(specs) and specs:
        kv = f"events from {with_events} of {len(specs)} workers (--kv-events)"
    elif with_events:
        kv = (
            f"events from {with_events} of {len(specs)} workers (--kv-events); the others' "
            "from their /kv_event_sources (vLLM), else approximate placements"
        )
    elif not settings.tokenizer:
        kv = "approximate (the router's own placements; engine events need --tokenizer)"
    else:
        kv = "events from the workers' /kv_event_sources (vLLM), else approximate placements"
    tokens = f"tokenizer {settings.tokenizer}" if settings.tokenizer else "approximate tokens"
    bs = (
        f"{settings.kv.block_size} until learned from events"
        if settings.kv.block_size
        else "learned from events"
    )
    if settings.kv.listen:
        kv += f"; listening on {settings.kv.listen} for engines that connect"
    procs = f", {settings.process_count} processes" if settings.process_count > 1 else ""
    return [
        f"switchyard router {version()}: listening on http://{settings.host}:{settings.port}"
        f"{procs}",
        f"  workers: {len(specs)} ({fleet})",
        f"  policy: {settings.policy}",
        f"  kv: {kv}" + ("" if kv.startswith("off") else f"; block size {bs}; {tokens}"),
        f"  redis: {settings.redis_url or _local_state(settings)}",
    ]


def _local_state(settings: RouterSettings) -> str:
    if settings.process_count > 1:
        return f"no (its {settings.process_count} processes share state over local sockets)"
    return "no (state is local to this process)"


# What each of several router processes reads to build its own copy of the app.
SETTINGS_ENV = "SWITCHYARD_ROUTER_PROCESS_SETTINGS"
CONFIG_ENV = "SWITCHYARD_ROUTER_PROCESS_CONFIG"
SIBLINGS_ENV = "SWITCHYARD_ROUTER_SIBLINGS_DIR"  # where the processes' sibling bus meets
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def run(settings: RouterSettings, config_file: str | Path | None = None) -> None:
    _logging(settings)
    print("\n".join(startup_summary(settings)), file=sys.stderr, flush=True)
    if settings.process_count > 1:
        _run_processes(settings, config_file)
        return
    app = build_app(settings, config_file)
    _tune_gc()
    _return_large_buffers()
    server = DrainingServer(uvicorn.Config(app, **_uvicorn_options(settings)), app)
    server.run()
    if not server.started:
        sys.exit(1)


class DrainingServer(uvicorn.Server):
    """A single router process's server: SIGTERM/SIGINT drain it (``drain``)."""

    def __init__(self, config: uvicorn.Config, app: RouterApp) -> None:
        super().__init__(config)
        self.app = app
        install(self)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        drain(self, self.app, sig, frame)


def drain(
    server: uvicorn.Server,
    app: RouterApp,
    sig: int,
    frame: FrameType | None,
    *,
    repeat_ends_drain: bool = True,
) -> None:
    """On SIGTERM/SIGINT, ``/ready`` answers 503 at once; after ``timeouts.drain_s`` the
    listener closes and in-flight requests get ``timeouts.shutdown_s`` to finish (uvicorn's
    graceful shutdown), then are cancelled (answered 503 ``shutting_down``) and the
    process exits. A second signal ends the drain at once unless ``repeat_ends_drain`` is
    off (a process of several gets the signal twice: from its group and from its parent)."""
    drain_s = app.settings.timeouts.drain_s
    if app.draining and not repeat_ends_drain:
        return
    exit_now = functools.partial(request_exit, server)
    if app.draining or drain_s <= 0:
        app.draining = True
        exit_now(sig, frame)
        return
    app.draining = True
    try:
        loop = asyncio.get_running_loop()  # the signal interrupted the server's loop
    except RuntimeError:
        exit_now(sig, frame)
        return
    loop.call_soon_threadsafe(loop.call_later, drain_s, exit_now, sig, None)


def _run_processes(settings: RouterSettings, config_file: str | Path | None) -> None:
    """Several router processes on one port, for more than one core's worth of requests.

    Each process has its own fleet view and KV store, following the engines itself. In-flight
    counts, admin changes and placements are shared through ``--redis`` if given, else over
    a sibling bus (``balancer.siblings``); the metrics of all of them are summed on every
    /metrics.
    """
    with tempfile.TemporaryDirectory(prefix="switchyard-router-") as state_dir:
        metrics_dir, siblings_dir = Path(state_dir, "metrics"), Path(state_dir, "siblings")
        metrics_dir.mkdir()
        siblings_dir.mkdir()
        os.environ[METRICS_DIR_ENV] = str(metrics_dir)
        if settings.redis_url is None:
            os.environ[SIBLINGS_ENV] = str(siblings_dir)
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        os.environ[CONFIG_ENV] = str(config_file or "")
        config = uvicorn.Config(
            "switchyard.router.server:process_app",
            factory=True,
            workers=settings.process_count,
            **_uvicorn_options(settings),
        )
        ClosingSupervisor(config, sockets=[config.bind_socket()]).run()


# How often the supervisor asks each of its processes whether it still answers.
PING_INTERVAL_S = 5.0


class ClosingSupervisor(Multiprocess):
    """uvicorn's process supervisor, closing its own copy of the listening socket once it
    has passed SIGTERM on. uvicorn's keeps it open until every process has exited, so
    while they finish their requests the kernel still accepted connections that no
    process would take, and reset them at exit, losing requests in ``bench.faults``'
    SIGTERM row under ``--processes 2``. Closed, a new
    connection is refused once the processes have closed theirs, as with one process.

    It also pings its processes every ``PING_INTERVAL_S``, not every 0.5 s: each ping wakes
    a thread of every process, which takes the GIL from its event loop, and at that rate
    the pings and pongs were much of an idle router's CPU. A process that
    exits is still seen within 0.5 s (``is_alive`` of the process, no ping)."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self._next_ping = 0.0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop_signal)

    def _stop_signal(self, sig: int, frame: FrameType | None) -> None:
        """Queue the signal for uvicorn's loop, and pass SIGTERM on to the processes now:
        the loop reads its queue only between health pings of every process (up to 5 s
        each when a process is busy), so their drain could begin late and the exit
        overrun the shutdown timeout (``bench.faults --only sigterm``)."""
        self.signal_queue.append(sig)
        for process in self.processes:
            pid = process.process.pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def keep_subprocess_alive(self) -> None:
        now = time.monotonic()
        if now < self._next_ping and all(p.process.is_alive() for p in self.processes):
            return
        self._next_ping = now + PING_INTERVAL_S
        super().keep_subprocess_alive()

    def terminate_all(self) -> None:
        super().terminate_all()
        for sock in self.sockets:
            sock.close()


def process_app() -> RouterApp:
    """The app of one of several router processes (uvicorn calls this in each)."""
    settings = RouterSettings.model_validate_json(os.environ[SETTINGS_ENV])
    _logging(settings)
    write_metrics_behind()
    siblings_dir = os.environ.get(SIBLINGS_ENV)
    siblings = SiblingBus(siblings_dir) if siblings_dir else None
    app = build_app(settings, os.environ.get(CONFIG_ENV) or None, siblings)
    _drain_on_signals(app)
    _tune_gc()
    _return_large_buffers()
    return app


def _drain_on_signals(app: RouterApp) -> None:
    """Make the signal handlers of this process's server drain ``app`` first, and give
    the server the router's main loop (``router.mainloop``).

    Under ``--processes`` uvicorn runs a plain ``uvicorn.Server`` in each process, which
    knows nothing of draining (``/ready`` stayed 200 and a request cancelled at the
    shutdown timeout lost its connection). It installs its handlers before it loads the
    app, so they can be wrapped here."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        server = getattr(signal.getsignal(sig), "__self__", None)
        if isinstance(server, uvicorn.Server):
            signal.signal(sig, functools.partial(drain, server, app, repeat_ends_drain=False))
    if isinstance(server, uvicorn.Server):
        install(server)  # it has not started its main loop yet


def _logging(settings: RouterSettings) -> None:
    """The root logger's one handler on stderr, in the ``log_format`` asked for; uvicorn's
    own loggers write through it too when it is json (``_uvicorn_options``)."""
    if settings.log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
        return
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _tune_gc() -> None:
    """The data path allocates few long-lived objects: move start-up objects out of the
    collector's view and collect young ones less often, which narrows the latency spread
    and tail at the same throughput."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def _return_large_buffers() -> None:
    """Give a large request body's memory back to the OS once it is freed.

    glibc raises its mmap threshold after the first large buffer is freed (up to 32 MiB),
    and later large buffers then come from the heap, which it does not shrink. Pinning the
    threshold keeps every buffer over 128 KiB in its own mapping, unmapped on free, so a
    couple of huge bodies do not leave the process's RSS raised for good. No effect off
    glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


# What a router process needs after its graceful window to answer the cancelled requests,
# close its clients and exit; under --processes the supervisor needs as long again to see
# its processes gone (it polls every 0.5 s, between health pings). Without the reserves
# the exit overran the shutdown timeout in bench.faults' sigterm rows; with them it ends
# within it.
EXIT_RESERVE_S = 1.0
SUPERVISOR_RESERVE_S = 1.0


def graceful_window_s(settings: RouterSettings) -> float:
    """How long in-flight requests may run after the listener closes, so that the process
    exits within ``timeouts.shutdown_s`` of SIGTERM (drain included), as an orchestrator's
    grace period expects. Never 0: uvicorn reads 0 as "wait for ever"."""
    reserve = EXIT_RESERVE_S + (SUPERVISOR_RESERVE_S if settings.process_count > 1 else 0.0)
    window = settings.timeouts.shutdown_s - settings.timeouts.drain_s - reserve
    return max(window, 0.01)


def _uvicorn_options(settings: RouterSettings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "lifespan": "on",
        "access_log": False,
        "proxy_headers": False,  # the router reads no X-Forwarded-*: one ASGI layer less
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": graceful_window_s(settings),
        # Not uvicorn's limit_concurrency: its 503 is plain text and leaves idle connections.
        "http": functools.partial(
            ClientConnection,
            limits=ConnectionLimits(
                header_timeout_s=settings.timeouts.header_s,
                body_timeout_s=settings.timeouts.body_s,
                max_connections=settings.limits.max_client_connections,
                max_header_bytes=settings.limits.max_header_bytes,
                keep_alive_s=settings.timeouts.keep_alive_s,
                retry_after_s=settings.retry.after_s,
            ),
        ),
        "server_header": False,
        "date_header": False,
        # json: no uvicorn handlers of its own, so its lines reach the root's JSON handler.
        **({"log_config": None} if settings.log_format == "json" else {}),
    }
