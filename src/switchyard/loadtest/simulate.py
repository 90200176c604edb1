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

The engines are, unless told otherwise, the engine model's own: Llama-3.1-8B on one 80 GB
H100 (``EngineConfig``: 29,000 KV blocks of 16 tokens) serving the model's 131,072-token
context. A request whose prompt + output exceeds that context (capped by what one engine's
KV cache holds) is refused before routing, as vLLM's API answers it with a 400; it counts as
an error and in ``refused_too_long``, and the run goes on.

What is not simulated: HTTP and client overheads, the router's own CPU time (the router
here decides instantly), KV-event transport lag (events are applied at the step that
emits them), the P/D decider (every request is disaggregated) and leg retries, probes,
scrapes and failures.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, Role, Ticket, Worker, WorkerSpec
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.metrics import KVStoreMetrics
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import CHARS_PER_TOKEN
from switchyard.loadtest.ceiling import Ceiling, ceiling_of
from switchyard.loadtest.client import Result
from switchyard.loadtest.compare import MODEL, CompareConfig, Run
from switchyard.loadtest.compare import Outcome as CompareOutcome
from switchyard.loadtest.metrics import SLO, Summary, summarize
from switchyard.loadtest.simworkload import SimWorkload, sim_workload
from switchyard.mock.engine.api import EngineRequest, context_length_error
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.events import KVEventBatch
from switchyard.mock.engine.virtual import RequestResult, VirtualFleet
from switchyard.mock.kvevents import encode_batch
from switchyard.mock.serve import engine_config
from switchyard.mock.settings import MockSettings
from switchyard.router.app import RouterApp
from switchyard.router.forward import queued_prefill
from switchyard.router.pd.pools import Pools
from switchyard.router.pd.settings import PDSettings
from switchyard.router.request import COMPLETIONS, RoutedRequest
from switchyard.router.scheduler.framework import Context
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.settings import KV, RouterSettings

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
class PolicyRun:
    policy: str
    summary: Summary
    ttft_ms: list[float]
    sim_s: float  # model seconds from the first arrival to the last event
    wall_s: float
    cpu_s: float  # this process's CPU time: on a shared machine, wall time measures the others
    decisions: int
    refused_too_long: int = 0  # refused with vLLM's 400: prompt + output over the context


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

    def submit_next() -> None:
        while True:
            item = next(arrivals, None)
            if item is None:
                return
            index, arrival_s, ids, max_tokens = item
            if not shape.refuses(len(ids), max_tokens):
                break
            refused.append(_refused(index, arrival_s, len(ids), shape.max_len))
        t = arrival_s * speed
        if not first:
            first.append(t)
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

    fleet.router = route_and_feed
    submit_next()
    started, cpu = time.perf_counter(), time.process_time()
    fleet.run()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    legs = fleet.results
    if pd:
        results = [
            _result(_client_view(r, legs.get("d" + rid[1:])), speed)
            for rid, r in legs.items()
            if rid.startswith("r")
        ]
    else:
        results = [_result(r, speed) for r in legs.values()]
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
    return PolicyRun(policy, summary, ttfts, sim_s, wall, cpu, router.decisions, len(refused))


def _refused(index: int, arrival_s: float, prompt_tokens: int, max_len: int) -> Result:
    """A client's record of a request the engine's API refused as longer than its context."""
    res = Result(index, arrival_s)
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
