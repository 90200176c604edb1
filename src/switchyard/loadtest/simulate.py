"""``switchyard simulate``: the router's own decisions over a virtual-clock mock fleet.

No HTTP and no sleeping. Every request is decided by the router's code: ``RouterApp.schedule``
(candidates, the KV store's prefix lookup, the policy's filters, scorers, picker and guard)
and ``Forwarder.place`` (DP rank, speculative placement), with the router's per-worker
accounting (``Fleet.begin`` / ``first_token`` / ``end``) moved at the simulated times a
request arrives, produces its first token and finishes. The engines are the mock's engine
core on ``VirtualFleet``; their KV events go through the wire encoding into the router's
own ``KVStore.ingest``, the same path a ZMQ frame takes. Only the clock is virtual: the
index's speculative entries and the occupancy snapshot age on it.

Times: a workload's seconds are wall seconds of a mock fleet running at ``speed`` (as in
``bench compare``); the engines run in model time (``arrival × speed``), and reported
latencies are model time ``/ speed``, i.e. what that mock fleet would show.

With ``prefill_engines`` set, the first that many engines are a prefill pool and the rest
a decode pool, ranked by the router's P/D pools (``router.pd.pools.Pools``) as its vLLM
flow does: the decode order and the prefill order at arrival, the prefill leg
(``max_tokens=1``, its KV held), the prompt recorded as placed on the prefill worker, then
the decode leg on the first decode worker with the prompt's KV pulled (the engine models
the transfer); the prefill's held blocks are freed when the decode leg's first token comes.
The client's TTFT is the decode leg's first token from the request's arrival.

Flow control runs as in the router, on by default (``SimConfig.flow``): the router's own
``FlowQueue`` and ``saturated`` with the router's ``Flow`` settings (its defaults unless
given), on the virtual clock. A request arriving while nothing waits and some candidate is
not saturated is routed at once; otherwise it waits in the queue (or is refused: 429
``queue_full`` over a cap, ``shed`` for a negative priority, ``queue_timeout`` past the
TTL). Waiting requests are dispatched, each routed at that moment, on every request's first
token and end and every scrape; a request's tenant is charged its actual prompt and output
tokens at its end. Saturation reads engine metrics as the router's scrape would have seen
them: every ``scrape_interval_ms`` (the router's own interval by default) each worker's
running and waiting requests and KV usage are sampled. The router does not queue for P/D pools (no
unified candidates), so neither does a P/D simulation.

Tenant rate limits (``flow.tenant_tokens_per_minute``, ``flow.tenant_requests_per_minute``)
are the router's ``TenantRateLimiter`` on the same virtual clock, applied first, as the
router applies them: a request reserves its prompt plus ``max_tokens`` at its arrival or is
refused 429 ``rate_limited``, is settled on its real prompt and output tokens at its end,
and is refunded when refused later (shed, queue full, timed out). A request too long for
the context is refused before flow control here, so it costs its tenant nothing, where the
router would charge its prompt since the engine's 400 reports no usage.

The engines are, unless told otherwise, the engine model's own: Llama-3.1-8B on one 80 GB
H100 (``EngineConfig``: 29,000 KV blocks of 16 tokens) serving the model's 131,072-token
context. A request whose prompt + output exceeds that context (capped by what one engine's
KV cache holds) is refused before routing, as vLLM's API answers it with a 400; it counts as
an error and in ``refused_too_long``, and the run goes on.

What is not simulated: HTTP and client overheads, the router's own CPU time (the router
here decides instantly), KV-event transport lag (events are applied at the step that
emits them), the P/D decider (every request is disaggregated) and leg retries, probes,
failures, scrape lag beyond the interval, clients retrying a refusal (a refused request is
not sent again), and rate limits shared with other router processes or replicas (one
router is simulated).
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import EngineSample, Outcome, Role, Ticket, Worker, WorkerSpec
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.metrics import KVStoreMetrics
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import CHARS_PER_TOKEN
from switchyard.loadtest.ceiling import Ceiling, ceiling_of
from switchyard.loadtest.client import Result
from switchyard.loadtest.compare import MODEL, CompareConfig, Run
from switchyard.loadtest.compare import Outcome as CompareOutcome
from switchyard.loadtest.metrics import SLO, Summary, percentile, summarize
from switchyard.loadtest.simworkload import Arrival, SimWorkload, sim_workload
from switchyard.mock.engine.api import EngineRequest, context_length_error
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.events import KVEventBatch
from switchyard.mock.engine.virtual import RequestResult, VirtualFleet
from switchyard.mock.kvevents import encode_batch
from switchyard.mock.serve import engine_config
from switchyard.mock.settings import MockSettings
from switchyard.router.app import RouterApp
from switchyard.router.flow.control import queue_limits_of, thresholds_of
from switchyard.router.flow.identity import DEFAULT_TENANT, Identity
from switchyard.router.flow.queue import FlowQueue, Queued, Refused
from switchyard.router.flow.ratelimit import (
    RateLimited,
    RateLimits,
    Reservation,
    TenantRateLimiter,
)
from switchyard.router.flow.saturation import saturated
from switchyard.router.forward import queued_prefill
from switchyard.router.pd.pools import Pools
from switchyard.router.pd.settings import PDSettings
from switchyard.router.request import COMPLETIONS, RoutedRequest
from switchyard.router.scheduler.framework import Context
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.settings import KV, Flow, RouterSettings

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits: the embedded store over the memory index does all
    its work without I/O, so the router's async API runs here without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a simulated router call waited for I/O")


@dataclass
class SimConfig:
    engines: int = 8
    workload: str = "multiturn"
    workload_params: dict[str, Any] = field(default_factory=dict)
    policies: list[str] = field(default_factory=lambda: ["kv_aware", "round_robin"])
    policy_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # KV blocks per engine; None: the engine model's (a realistic 8B engine, not a toy).
    num_gpu_blocks: int | None = None
    # The served context, tokens; None: the mock's (the model's own context length).
    max_model_len: int | None = None
    # Workload seconds are wall seconds of a mock fleet at this speed (bench compare's --speed).
    speed: float = 1.0
    dp_size: int = 1
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    # YAML with a 'mock' section for every engine (timing model, limits), as mock-fleet takes.
    mock_config: Path | None = None
    # Keep every token's time (ITL percentiles); off saves memory on large runs.
    record_token_times: bool = True
    # P/D: the first this many of ``engines`` prefill, the rest decode; 0 = unified workers.
    prefill_engines: int = 0
    # Flow control as the router runs it (off: every request is routed at its arrival).
    flow: bool = True
    flow_settings: Flow = field(default_factory=Flow)
    # Between engine metrics scrapes, in the workload's (wall) milliseconds; None: the
    # router's own scrape interval.
    scrape_interval_ms: float | None = None

    def scrape_interval_s(self) -> float:
        if self.scrape_interval_ms is None:
            return BalancerSettings().scrape_interval_s
        return self.scrape_interval_ms / 1000.0

    def settings(self) -> MockSettings:
        return MockSettings.load(
            self.mock_config,
            num_gpu_blocks=self.num_gpu_blocks,
            max_model_len=self.max_model_len,
            seed=self.seed,
        )

    def engine_config(self) -> EngineConfig:
        return engine_config(self.settings())

    def engine(self) -> SimEngine:
        settings = self.settings()
        config = engine_config(settings)
        return SimEngine(
            config.num_gpu_blocks,
            config.block_size,
            settings.max_model_len,
            config.context_limit(settings.max_model_len),
        )


@dataclass(frozen=True)
class SimEngine:
    """Which engine is simulated: what a reader needs to judge the figures."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int  # the model's context as configured
    max_len: int  # what is served: the context, capped by one engine's KV cache

    def refuses(self, prompt_tokens: int, max_tokens: int) -> bool:
        return context_length_error(self.max_len, prompt_tokens, max_tokens) is not None

    def describe(self) -> str:
        capped = (
            f" (one engine's KV cache; {self.max_model_len} configured)"
            if self.max_len < self.max_model_len
            else ""
        )
        return (
            f"{self.num_gpu_blocks} KV blocks of {self.block_size} tokens per engine, "
            f"max model len {self.max_len}{capped}"
        )

    def as_json(self) -> dict[str, int]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_len,
        }


@dataclass
class TenantFigures:
    """One tenant's share of a run: what it asked, what it was served, how long it waited.
    Times are in the report's (wall) seconds; waits are of the requests dispatched."""

    requests: int = 0
    served: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> requests
    ttft_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    def ttft_ms(self) -> dict[str, float | None]:
        return _quantiles_ms(self.ttft_s)

    def wait_ms(self) -> dict[str, float | None]:
        return _quantiles_ms(self.wait_s)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "served": self.served,
            "refused": dict(sorted(self.refused.items())),
            "ttft_ms": _rounded(self.ttft_ms()),
            "queue_wait_ms": _rounded(self.wait_ms()),
            "served_tokens": {"prompt": self.prompt_tokens, "output": self.output_tokens},
        }


def _quantiles_ms(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in (50, 90):
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else v * 1e3
    return out


def tenant_figures(results: list[Result], waits: dict[int, float]) -> dict[str, TenantFigures]:
    """Per tenant, by name: each request served (its TTFT, its wait, its tokens) or refused
    (by reason: flow control's, ``too_long`` for vLLM's 400, else ``error``)."""
    out: dict[str, TenantFigures] = {}
    for r in results:
        fig = out.get(r.tenant or DEFAULT_TENANT)
        if fig is None:
            fig = out[r.tenant or DEFAULT_TENANT] = TenantFigures()
        fig.requests += 1
        if r.ok:
            fig.served += 1
            if r.ttft_s is not None:
                fig.ttft_s.append(r.ttft_s)
            fig.wait_s.append(waits.get(r.index, 0.0))
            fig.prompt_tokens += r.prompt_tokens
            fig.output_tokens += r.output_tokens
        else:
            reason = r.reason or ("too_long" if r.status == 400 else "error")
            fig.refused[reason] = fig.refused.get(reason, 0) + 1
    return dict(sorted(out.items()))


@dataclass
class PolicyRun:
    policy: str
    summary: Summary
    ttft_ms: list[float]
    sim_s: float  # model seconds from the first arrival to the last event
    wall_s: float
    cpu_s: float  # this process's CPU time: on a shared machine, wall time measures the others
    decisions: int
    refused_too_long: int = 0  # refused with vLLM's 400: prompt + output over the context
    tenants: dict[str, TenantFigures] = field(default_factory=dict)
    flow: bool = False  # whether flow control ran (not for P/D pools, as in the router)

    @property
    def refused_by_flow(self) -> dict[str, int]:
        """Flow control's refusals over every tenant, by reason."""
        out: dict[str, int] = {}
        for fig in self.tenants.values():
            for reason, n in fig.refused.items():
                if reason not in ("too_long", "error"):
                    out[reason] = out.get(reason, 0) + n
        return dict(sorted(out.items()))


@dataclass
class SimOutcome:
    config: SimConfig
    workload: SimWorkload
    ceiling: Ceiling
    engine: SimEngine
    runs: list[PolicyRun] = field(default_factory=list)
    setup_wall_s: float = 0.0
    peak_rss_bytes: int = 0

    @property
    def sim_s(self) -> float:
        return sum(r.sim_s for r in self.runs)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.runs)

    @property
    def cpu_s(self) -> float:
        return sum(r.cpu_s for r in self.runs)

    @property
    def flow(self) -> bool:
        return any(r.flow for r in self.runs)

    @property
    def refused_too_long(self) -> int:
        """Requests no engine could hold (the same in every run: it depends on the workload)."""
        return max((r.refused_too_long for r in self.runs), default=0)

    def as_compare(self) -> CompareOutcome:
        """The same shape ``bench compare`` reports, so its table and JSON apply as they are."""
        cfg = self.config
        compare_cfg = CompareConfig(
            engines=cfg.engines,
            workload=cfg.workload,
            policies=list(cfg.policies),
            workload_params=dict(cfg.workload_params),
            num_gpu_blocks=self.engine.num_gpu_blocks,
            speed=cfg.speed,
            seed=cfg.seed,
            repeats=1,
            slo_ttft_ms=cfg.slo_ttft_ms,
            slo_tpot_ms=cfg.slo_tpot_ms,
            mock_config=cfg.mock_config,
            progress=False,
        )
        out = CompareOutcome(compare_cfg, self.workload.as_workload(), self.ceiling)
        out.runs = [Run(r.policy, 0, r.summary, r.ttft_ms) for r in self.runs]
        out.wall_s = self.wall_s
        return out

    def headline(self) -> dict[str, Any]:
        """The one JSON line ``--json`` ends with."""
        return {
            "engines": self.config.engines,
            "dp_size": self.config.dp_size,
            "prefill_engines": self.config.prefill_engines,
            "flow": self.flow,
            "scrape_interval_ms": round(self.config.scrape_interval_s() * 1e3, 3),
            "workload": self.workload.name,
            "requests": len(self.workload),
            "engine": self.engine.as_json(),
            "refused_too_long": self.refused_too_long,
            "sim_seconds": round(self.sim_s, 3),
            "wall_seconds": round(self.wall_s, 3),
            "cpu_seconds": round(self.cpu_s, 3),
            "setup_wall_seconds": round(self.setup_wall_s, 3),
            "speedup": round(self.sim_s / self.wall_s, 1) if self.wall_s else None,
            "peak_rss_bytes": self.peak_rss_bytes,
            "ceiling_hit_rate": round(self.ceiling.bounded_hit_rate, 4),
            "policies": {
                r.policy: {
                    "hit_rate": round(r.summary.hit_rate, 4),
                    "ttft_ms": _rounded(r.summary.ttft_ms),
                    "tpot_ms": _rounded(r.summary.tpot_ms),
                    "goodput_rps": round(r.summary.goodput_rps, 3),
                    "load_spread": None if r.summary.spread is None else round(r.summary.spread, 3),
                    "errors": r.summary.errors,
                    "refused_too_long": r.refused_too_long,
                    "refused": r.refused_by_flow,
                    "tenants": {name: fig.as_json() for name, fig in r.tenants.items()},
                    "sim_seconds": round(r.sim_s, 3),
                    "wall_seconds": round(r.wall_s, 3),
                    "cpu_seconds": round(r.cpu_s, 3),
                }
                for r in self.runs
            },
        }


def _rounded(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 2) for k, v in values.items()}


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Children:
    """A labelled Prometheus metric whose children are looked up once per label set.

    ``labels()`` takes a lock and builds a key on every call; the store calls it for every
    event batch, a visible share of a simulation's CPU over a thousand engines. The
    children are the metric's own, so the figures are the same.
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metric, name)


def store_metrics() -> KVStoreMetrics:
    """The store's metrics with cached children for every labelled one."""
    metrics = KVStoreMetrics()
    for name, metric in list(vars(metrics).items()):
        if getattr(metric, "_labelnames", ()):
            setattr(metrics, name, _Children(metric))
    return metrics


class SimRouter:
    """One router (one policy) deciding for a virtual fleet, on the fleet's clock."""

    def __init__(self, cfg: SimConfig, policy: str, block_size: int) -> None:
        self.cfg = cfg
        self.now = 0.0
        dp = cfg.dp_size
        pd = cfg.prefill_engines

        def role(i: int) -> Role:
            if not pd:
                return Role.UNIFIED
            return Role.PREFILL if i < pd else Role.DECODE

        specs = [
            WorkerSpec(url=f"http://sim-engine-{i}", models=[MODEL], dp_size=dp, role=role(i))
            for i in range(cfg.engines)
        ]
        # Slow start ramps on the wall clock; simulated workers are warm from the start.
        self.fleet = Fleet(BalancerSettings(slow_start_s=0.0), specs=specs)
        self.workers = self.fleet.workers()
        self.engine_of = {
            (w.id, rank): i * dp + rank for i, w in enumerate(self.workers) for rank in range(dp)
        }
        clock = self._clock
        self.store = KVStore(
            MemoryIndex(clock=clock), block_size=block_size, seed=cfg.seed, metrics=store_metrics()
        )
        options = {"seed": cfg.seed, **cfg.policy_options}
        scheduler = build_scheduler(policy, options, block_size=block_size)
        settings = RouterSettings(
            policy=policy, policy_options=options, kv=KV(block_size=block_size)
        )
        self.app = RouterApp(settings, self.fleet, scheduler, self.store, clock=clock)
        self.tickets: dict[str, Ticket] = {}
        self.decisions = 0
        self.index_of = {w.id: i for i, w in enumerate(self.workers)}
        # P/D: both pools ranked by the policy under test, as the router's pools rank them.
        per_pool = {"prefill": options, "decode": options}
        self.pools = Pools(
            self.fleet,
            PDSettings(prefill_policy=policy, decode_policy=policy, policy_options=per_pool),
            has_kvstore=True,
        )
        # Request id -> (decode worker, prefill context and worker, prompt, output tokens).
        self.legs: dict[str, tuple[Worker, Context, Worker, list[int], int]] = {}
        self.pd_output: dict[str, int] = {}  # request id -> output tokens of its decode leg
        self.output_token_ids: list[int] | None = None

    def _clock(self) -> float:
        return self.now

    def sink(self, engine_index: int) -> Callable[[KVEventBatch], None]:
        """The engine's KV events, on the wire and into the store as a ZMQ frame would go."""
        worker = self.workers[engine_index // self.cfg.dp_size]
        rank = engine_index % self.cfg.dp_size
        ingest = self.store.ingest

        def publish(batch: KVEventBatch) -> None:
            batch.data_parallel_rank = rank
            run_sync(ingest(worker.id, encode_batch(batch), dp_rank=rank))

        return publish

    def route(self, fleet: VirtualFleet, t: float, request: EngineRequest) -> int:
        self.now = t
        ids = request.prompt_token_ids
        req = RoutedRequest(
            COMPLETIONS,
            b"",
            {"model": MODEL, "prompt": ids},
            MODEL,
            True,
            None,
            len(ids) * CHARS_PER_TOKEN,
        )
        rid = request.request_id
        ctx, ranked = run_sync(self.app.schedule(req, rid.encode(), "normal", None))
        worker = ranked[0]
        rank = run_sync(self.app.forwarder.place(ctx, worker))
        ticket = self.fleet.begin(
            worker,
            prompt_tokens=ctx.prompt_tokens,
            dp_rank=rank,
            prefill_tokens=queued_prefill(ctx, worker),
        )
        self.tickets[rid] = ticket
        self.decisions += 1
        return self.engine_of[(worker.id, ticket.rank)]

    def route_pd(self, fleet: VirtualFleet, t: float, request: EngineRequest) -> int:
        """The prefill leg's engine, with the decode worker chosen at the same moment (the
        order of the router's vLLM P/D flow)."""
        self.now = t
        ids = request.prompt_token_ids
        req = RoutedRequest(
            COMPLETIONS, b"", {"model": MODEL, "prompt": ids}, MODEL, True, None,
            len(ids) * CHARS_PER_TOKEN,
        )  # fmt: skip
        rid = request.request_id
        kv = self.app.kv
        assert kv is not None
        pools = self.pools
        ctx = pools.context(req, rid)
        decode_workers = self.fleet.candidates(MODEL, Role.DECODE)
        run_sync(kv.annotate(ctx, req, decode_workers))
        decode = pools.ranked(Role.DECODE, ctx, decode_workers)
        pctx = pools.context(req, rid)
        prefill_workers = self.fleet.candidates(MODEL, Role.PREFILL)
        if pools.needs_prefix(Role.PREFILL):
            run_sync(kv.annotate(pctx, req, prefill_workers))
        prefill = pools.ranked(Role.PREFILL, pctx, prefill_workers)[0]
        self.tickets[rid] = self.fleet.begin(
            prefill, prompt_tokens=pctx.prompt_tokens, prefill_tokens=queued_prefill(pctx, prefill)
        )
        self.legs[rid] = (decode[0], pctx, prefill, ids, self.pd_output.pop(rid))
        self.decisions += 1
        return self.index_of[prefill.id]

    def first_token(self, fleet: VirtualFleet, res: RequestResult) -> None:
        self.now = fleet.now
        self.fleet.first_token(self.tickets[res.request_id])
        if res.request_id.startswith("d"):  # the decode leg pulled the prompt's KV
            prefill_id = "r" + res.request_id[1:]
            fleet.release_held(fleet.results[prefill_id].engine_index, prefill_id)

    def finished(self, fleet: VirtualFleet, res: RequestResult) -> None:
        self.now = fleet.now
        rid = res.request_id
        ticket = self.tickets.pop(rid)
        ok = res.finish_reason == "length"
        self.fleet.end(ticket, Outcome.SUCCESS if ok else Outcome.CLIENT_ABORT)
        leg = self.legs.pop(rid, None)
        if leg is None or not ok:
            return
        decode, pctx, prefill, ids, max_tokens = leg
        run_sync(self.app.kv.placed(pctx, prefill, None))  # type: ignore[union-attr]
        did = "d" + rid[1:]
        self.tickets[did] = self.fleet.begin(decode, prompt_tokens=len(ids), prefill_tokens=0)
        request = EngineRequest(
            did, ids, max_tokens, remote_prefilled_tokens=len(ids),
            output_token_ids=self.output_token_ids,
        )  # fmt: skip
        fleet.submit(fleet.now, self.index_of[decode.id], request)


class _Scraped:
    """A worker as flow control's saturation check reads it, with its engines' metrics as the
    last scrape on the virtual clock saw them. The worker's own sample stays unset: its
    ``load()`` ages a sample on the host's monotonic clock, against which a virtual scrape
    time means nothing, so scrape-reading scorers would depend on the host's uptime."""

    __slots__ = ("_worker", "_cores", "engine", "scraped_at")

    def __init__(self, worker: Worker, cores: list[EngineCore]) -> None:
        self._worker = worker
        self._cores = cores
        self.engine: EngineSample | None = None
        self.scraped_at: float | None = None

    @property
    def healthy(self) -> bool:
        return self._worker.healthy

    @property
    def draining(self) -> bool:
        return self._worker.draining

    @property
    def inflight(self) -> int:
        return self._worker.inflight

    @property
    def totals(self) -> Any:
        return self._worker.totals

    def scrape(self, at: float) -> None:
        """The engines' running and waiting requests and KV usage now (a worker's DP ranks
        summed, their usage averaged), exact even mid-jump: a decode jump moves no block."""
        running = waiting = 0
        usage = 0.0
        for core in self._cores:
            running += len(core.running)
            waiting += len(core.waiting)
            usage += core.pool.usage
        usage /= len(self._cores)
        sample = self.engine
        if sample is None:
            self.engine = EngineSample(running, waiting, usage)
        else:
            sample.running, sample.waiting, sample.kv_usage = running, waiting, usage
        self.scraped_at = at


class SimFlow:
    """The router's flow control over a simulated fleet, on its clock in the report's (wall)
    seconds: ``FlowQueue`` decides who goes next and ``saturated`` whether a worker has room,
    as ``router.flow.control`` drives them, with the dispatch routed at once (so there is no
    "starting" state to wait for) and the engines' metrics from periodic scrapes; the
    tenants' rate limits are ``TenantRateLimiter``'s, reserved before anything else."""

    def __init__(
        self,
        cfg: SimConfig,
        workload: SimWorkload,
        router: SimRouter,
        fleet: VirtualFleet,
        refused: list[Result],
    ) -> None:
        flow = cfg.flow_settings
        self.speed = cfg.speed
        self.workload = workload
        self.router = router
        self.fleet = fleet
        self.refused = refused
        self.thresholds = thresholds_of(flow)
        self.queue = FlowQueue(queue_limits_of(flow), self.clock)
        limits = RateLimits(flow.tenant_tokens_per_minute, flow.tenant_requests_per_minute)
        self.limiter = TenantRateLimiter(limits, self.clock) if limits.enabled else None
        dp = cfg.dp_size
        self.views = {
            w.id: _Scraped(w, fleet.cores[i * dp : (i + 1) * dp])
            for i, w in enumerate(router.workers)
        }
        self.interval_s = cfg.scrape_interval_s()
        if self.interval_s <= 0:
            raise ValueError("scrape_interval_ms must be positive")
        self.tick = -1  # the last scrape, in intervals from the start
        self.arrived: dict[str, float] = {}  # request id -> arrival (model time), if queued
        self.waits: dict[int, float] = {}  # request index -> its wait in the queue, seconds
        # request id -> tenant and its rate-limit reservation, until its end is charged
        self.serving: dict[str, tuple[str, Reservation | None]] = {}

    def clock(self) -> float:
        return self.fleet.now / self.speed

    @property
    def busy(self) -> bool:
        """Anything in flight or waiting: the scrapes matter only then (an idle worker is
        never saturated), so an idle gap runs no scrape."""
        return bool(self.router.tickets) or bool(self.queue.size)

    def next_scrape(self) -> float:
        """The model time of the next scrape."""
        return (self.tick + 1) * self.interval_s * self.speed

    def scrape(self, tick: int) -> None:
        at = tick * self.interval_s
        for view in self.views.values():
            view.scrape(at)
        self.tick = tick

    def catch_up(self) -> None:
        """The scrape due by now, after an idle gap (the engines are as they were then)."""
        tick = math.floor(self.clock() / self.interval_s)
        if tick > self.tick:
            self.scrape(tick)

    def can_serve(self, model: str, prompt_tokens: int = 0) -> bool:
        """``FlowControl.can_serve``: some candidate of ``model`` has room for
        ``prompt_tokens``."""
        candidates = self.router.fleet.candidates(model)
        if not candidates:
            return True
        views, thresholds, now = self.views, self.thresholds, self.clock()
        for worker in candidates:
            if not saturated(cast(Worker, views[worker.id]), thresholds, now, 1, prompt_tokens):
                return True
        return False

    def arrive(self, index: int, ids: list[int], max_tokens: int) -> None:
        """``FlowControl.admit`` at the request's arrival (``fleet.now``): the rate limit
        first, then at once, queued or refused; a request refused after its reservation
        gives it back."""
        self.catch_up()
        t = self.fleet.now
        workload = self.workload
        request = EngineRequest(
            f"r{index}", ids, max_tokens, output_token_ids=workload.output_token_ids
        )
        identity = Identity(workload.tenant(index), workload.priority(index))
        tenant = identity.tenant
        reservation = None
        if self.limiter is not None:
            try:
                reservation = self.limiter.reserve(tenant, len(ids), max_tokens)
            except RateLimited as limited:
                self.refuse(index, tenant, len(ids), t, limited.reason)
                return
        queue = self.queue
        if not queue.size and self.can_serve(MODEL, len(ids)):
            self.dispatch(index, tenant, request, t, reservation)
            return
        if identity.sheddable and not self.can_serve(MODEL, len(ids)):
            self.cancel(reservation)
            self.refuse(index, tenant, len(ids), t, "shed")
            return
        size = len(ids) * CHARS_PER_TOKEN
        payload = (index, request, t, reservation)
        item = Queued(identity, MODEL, size, len(ids), self.clock(), payload)
        try:
            queue.push(item)
        except Refused:
            self.cancel(reservation)
            self.refuse(index, tenant, len(ids), t, "queue_full")
            return
        self.pump()

    def cancel(self, reservation: Reservation | None) -> None:
        """``FlowControl._cancel``: refund a request that never reached an engine."""
        if reservation is not None and self.limiter is not None:
            self.limiter.cancel(reservation)

    def pump(self) -> None:
        """``FlowControl.pump``: refuse the expired, dispatch while some worker has room."""
        queue = self.queue
        for expired in queue.expire():
            index, request, t, reservation = expired.payload
            tenant = expired.identity.tenant
            self.cancel(reservation)
            self.refuse(index, tenant, len(request.prompt_token_ids), t, "queue_timeout")
        while queue.size:
            item = queue.pop(self.can_serve)
            if item is None:
                break
            index, request, t, reservation = item.payload
            self.dispatch(index, item.identity.tenant, request, t, reservation)

    def dispatch(
        self,
        index: int,
        tenant: str,
        request: EngineRequest,
        arrived: float,
        reservation: Reservation | None = None,
    ) -> None:
        """Route the request now (KV-aware against the fleet as it is now) and start it."""
        fleet = self.fleet
        t = fleet.now
        rid = request.request_id
        fleet.submit(t, self.router.route(fleet, t, request), request)
        self.serving[rid] = (tenant, reservation)
        if t > arrived:
            self.arrived[rid] = arrived
            self.waits[index] = (t - arrived) / self.speed

    def refuse(
        self, index: int, tenant: str, prompt_tokens: int, arrived: float, reason: str
    ) -> None:
        """A client's record of a request flow control refused (429 and its reason)."""
        res = Result(index, arrived / self.speed, tenant=tenant)
        res.status = 429
        res.reason = reason
        res.prompt_tokens = prompt_tokens
        res.error = f"429: {reason}"
        self.refused.append(res)

    def finished(self, fleet: VirtualFleet, res: RequestResult) -> None:
        """``FlowControl.release``: charge the tenant what it was served (its fair share, and
        its rate limit settled on the real tokens), then pump."""
        self.router.finished(fleet, res)
        served = self.serving.pop(res.request_id, None)
        if served is not None:
            tenant, reservation = served
            self.queue.charge(tenant, res.prompt_tokens, res.output_tokens)
            if reservation is not None and self.limiter is not None:
                self.limiter.settle(reservation, res.prompt_tokens, res.output_tokens)
        if self.queue.size:
            self.pump()

    def first_token(self, fleet: VirtualFleet, res: RequestResult) -> None:
        """``FlowControl.prefilled``: the worker's queued prefill shrank, so a waiting
        request may fit now."""
        self.router.first_token(fleet, res)
        if self.queue.size:
            self.pump()

    def run(self, pull: Callable[[], Arrival | None]) -> None:
        """Arrivals and scrapes in time order, the fleet run up to each; scrapes only while
        anything is in flight or waiting."""
        fleet = self.fleet
        speed = self.speed
        nxt = pull()
        while True:
            scrape_t = self.next_scrape() if self.busy else math.inf
            arrival_t = nxt[1] * speed if nxt is not None else math.inf
            t = min(scrape_t, arrival_t)
            if t == math.inf:
                fleet.run()
                # The run ends at its last event, not at the scrape or arrival after it.
                ends = (r.finish_time for r in fleet.results.values())
                fleet.now = max((e for e in ends if e is not None), default=fleet.now)
                return
            fleet.run(until=t)
            fleet.now = t
            if scrape_t <= t:
                self.scrape(self.tick + 1)
                if self.queue.size:
                    self.pump()
            if nxt is not None and arrival_t <= t:
                index, _, ids, max_tokens = nxt
                self.arrive(index, ids, max_tokens)
                nxt = pull()


def run_policy(cfg: SimConfig, workload: SimWorkload, policy: str) -> PolicyRun:
    """One policy over the whole workload; prompts are built as they arrive, and one that no
    engine can hold is refused there and then (vLLM's 400), never reaching the router."""
    engine = cfg.engine_config()
    shape = cfg.engine()
    refused: list[Result] = []
    router = SimRouter(cfg, policy, engine.block_size)
    n = cfg.engines * cfg.dp_size
    fleet = VirtualFleet(
        [engine] * n,
        router.route,
        [router.sink(i) for i in range(n)],
        record_token_times=cfg.record_token_times,
        on_finish=router.finished,
        on_first_token=router.first_token,
    )
    speed = cfg.speed
    arrivals = iter(workload.requests())
    first: list[float] = []
    pd = cfg.prefill_engines > 0
    router.output_token_ids = workload.output_token_ids

    def pull() -> Arrival | None:
        """The next arrival that an engine can hold; the others are refused on the way."""
        while True:
            item = next(arrivals, None)
            if item is None:
                return None
            index, arrival_s, ids, max_tokens = item
            if not shape.refuses(len(ids), max_tokens):
                if not first:
                    first.append(arrival_s * speed)
                return item
            refused.append(
                _refused(index, arrival_s, len(ids), shape.max_len, workload.tenant(index))
            )

    def submit_next() -> None:
        item = pull()
        if item is None:
            return
        index, arrival_s, ids, max_tokens = item
        t = arrival_s * speed
        rid = f"r{index}"
        if pd:  # the prefill leg; its decode leg follows when it finishes
            router.pd_output[rid] = max_tokens
            request = EngineRequest(rid, ids, 1, hold_kv_after_prefill=True)
        else:
            request = EngineRequest(
                rid, ids, max_tokens, output_token_ids=workload.output_token_ids
            )
        fleet.submit(t, None, request)

    decide = router.route_pd if pd else router.route

    def route_and_feed(vf: VirtualFleet, t: float, request: EngineRequest) -> int:
        submit_next()
        return decide(vf, t, request)

    # The router queues only for unified workers (P/D pools have no unified candidates).
    flow = SimFlow(cfg, workload, router, fleet, refused) if cfg.flow and not pd else None
    started, cpu = time.perf_counter(), time.process_time()
    if flow is None:
        fleet.router = route_and_feed
        submit_next()
        fleet.run()
    else:
        fleet.on_finish = flow.finished
        fleet.on_first_token = flow.first_token
        flow.run(pull)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    legs = fleet.results
    if pd:
        results = [
            _result(_client_view(r, legs.get("d" + rid[1:])), speed)
            for rid, r in legs.items()
            if rid.startswith("r")
        ]
    else:
        arrived = flow.arrived if flow is not None else {}
        results = [
            _result(dataclasses.replace(r, arrival=arrived[rid]) if rid in arrived else r, speed)
            for rid, r in legs.items()
        ]
    for res in results:
        res.tenant = workload.tenant(res.index)
    results.extend(refused)
    served = [0] * cfg.engines
    for r in fleet.results.values():
        served[r.engine_index // cfg.dp_size] += 1
    summary = summarize(results, SLO(cfg.slo_ttft_ms / 1e3, cfg.slo_tpot_ms / 1e3), served)
    stats = [fleet.stats(i) for i in range(n)]
    queried = sum(s.prefix_cache_queries for s in stats)
    summary.engine_hit_rate = sum(s.prefix_cache_hits for s in stats) / queried if queried else None
    ttfts = [r.ttft_s * 1e3 for r in results if r.ok and r.ttft_s is not None]
    sim_s = fleet.now - (first[0] if first else 0.0)
    too_long = sum(1 for r in refused if r.status == 400)
    tenants = tenant_figures(results, flow.waits if flow is not None else {})
    return PolicyRun(
        policy, summary, ttfts, sim_s, wall, cpu, router.decisions, too_long, tenants,
        flow is not None,
    )  # fmt: skip


def _refused(index: int, arrival_s: float, prompt_tokens: int, max_len: int, tenant: str) -> Result:
    """A client's record of a request the engine's API refused as longer than its context."""
    res = Result(index, arrival_s, tenant=tenant)
    res.status = 400
    res.prompt_tokens = prompt_tokens
    res.error = f"400: prompt + max_tokens over the {max_len}-token context"
    return res


def _client_view(prefill: RequestResult, decode: RequestResult | None) -> RequestResult:
    """What the client of a P/D request saw: the decode leg's tokens from its own arrival,
    with the prompt and cache hit of the prefill leg."""
    if decode is None:
        return prefill
    return RequestResult(
        prefill.request_id,
        decode.engine_index,
        prefill.arrival,
        prefill.prompt_tokens,
        decode.first_token_time,
        decode.finish_time,
        decode.token_times,
        prefill.num_cached_tokens,
        decode.output_tokens,
        decode.finish_reason,
    )


def _result(r: RequestResult, speed: float) -> Result:
    """A replay client's record of one simulated request (latencies in ``/ speed`` time)."""
    ok = r.finish_reason == "length" and r.first_token_time is not None
    res = Result(int(r.request_id[1:]), r.arrival / speed)
    res.ok = ok
    res.status = 200 if ok else 499
    if r.first_token_time is not None:
        res.ttft_s = (r.first_token_time - r.arrival) / speed
    if r.finish_time is not None:
        res.e2e_s = (r.finish_time - r.arrival) / speed
        res.done_s = r.finish_time / speed
    res.prompt_tokens = r.prompt_tokens
    res.cached_tokens = r.num_cached_tokens
    res.output_tokens = r.output_tokens
    res.itl_s = [gap / speed for gap in r.itl]
    if not ok:
        res.error = f"finished: {r.finish_reason}"
    return res


def simulate(cfg: SimConfig, on_run: Callable[[PolicyRun], None] | None = None) -> SimOutcome:
    """Every policy over the same workload on a fresh simulated fleet."""
    if cfg.engines < 1:
        raise ValueError("engines must be at least 1")
    if cfg.dp_size < 1:
        raise ValueError("dp_size must be at least 1")
    if cfg.prefill_engines and not 0 < cfg.prefill_engines < cfg.engines:
        raise ValueError("prefill_engines must leave at least one decode engine")
    if cfg.prefill_engines and cfg.dp_size != 1:
        raise ValueError("P/D pools are simulated with one DP rank per engine")
    if cfg.speed <= 0:
        raise ValueError("speed must be positive")
    if not cfg.policies:
        raise ValueError("no policy given")
    started = time.perf_counter()
    engine = cfg.engine()
    for policy in cfg.policies:
        build_scheduler(policy, {"seed": cfg.seed, **cfg.policy_options}, block_size=16)
    workload = sim_workload(cfg.workload, cfg.seed, cfg.workload_params)
    capacity = cfg.engines * cfg.dp_size * engine.num_gpu_blocks
    # The ceiling is of what can be served: a refused request caches nothing.
    outputs = workload.output_lengths()
    fits = [i for i, out in enumerate(outputs) if not engine.refuses(workload.prompt_len(i), out)]
    ceil = ceiling_of(
        lambda: (workload.prompt(i) for i in fits),
        [outputs[i] for i in fits],
        engine.block_size,
        capacity,
    )
    outcome = SimOutcome(cfg, workload, ceil, engine, setup_wall_s=time.perf_counter() - started)
    for policy in cfg.policies:
        run = run_policy(cfg, workload, policy)
        outcome.runs.append(run)
        if on_run is not None:
            on_run(run)
    outcome.peak_rss_bytes = peak_rss_bytes()
    return outcome
