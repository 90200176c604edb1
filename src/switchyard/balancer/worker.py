"""One worker of the fleet: its declared spec and its live state.

The router reads ``Worker`` attributes on every request, so the state is plain
attributes updated in place by the fleet; nothing here does I/O.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from switchyard.balancer.health import Breaker, Circuit, OutlierWindow
from switchyard.balancer.settings import BalancerSettings

# Per-rank counters are allocated up front: a bound keeps a typo (or a hostile admin call)
# such as dp=10**9 from allocating gigabytes. The largest DP deployments run a few hundred.
MAX_DP_SIZE = 1024


class Role(StrEnum):
    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class Outcome(StrEnum):
    """How a request to a worker ended, as the router saw it."""

    SUCCESS = "success"
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"
    CLIENT_ABORT = "client_abort"

    @property
    def is_failure(self) -> bool:
        return self in _FAILURES


_FAILURES = frozenset({Outcome.CONNECT_ERROR, Outcome.TIMEOUT, Outcome.SERVER_ERROR})

_SPEC_KEYS = {
    "role": "role",
    "dp": "dp_size",
    "dp_size": "dp_size",
    "dp_mode": "dp_mode",
    "ranks": "rank_urls",
    "rank_urls": "rank_urls",
    "kv": "kv_events",
    "kv_events": "kv_events",
    "bootstrap": "bootstrap_port",
    "bootstrap_port": "bootstrap_port",
    "flavor": "flavor",
    "models": "models",
    "model": "models",
}


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


@dataclass
class WorkerSpec:
    """What a worker is, as declared by config, admin API, file or Kubernetes."""

    url: str
    models: list[str] = field(default_factory=list)
    role: Role = Role.UNIFIED
    flavor: str | None = None
    dp_size: int = 1
    dp_mode: str = "header"
    rank_urls: list[str] = field(default_factory=list)
    kv_events: str | None = None
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        self.url = normalise_url(self.url)
        self.role = Role(self.role)
        self.rank_urls = [normalise_url(u) for u in self.rank_urls]
        if self.dp_mode not in ("header", "urls"):
            raise ValueError(f"dp_mode must be 'header' or 'urls', not {self.dp_mode!r}")
        if self.rank_urls:
            self.dp_mode = "urls"
            self.dp_size = len(self.rank_urls)
        if not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be between 1 and {MAX_DP_SIZE}")
        if self.bootstrap_port is not None and not 1 <= self.bootstrap_port <= 65535:
            raise ValueError("bootstrap_port must be a TCP port (1-65535)")
        if self.flavor is not None and self.flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor must be 'vllm' or 'sglang', not {self.flavor!r}")

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """``http://h:p`` or ``http://h:p;role=prefill;dp=4;kv=tcp://h:5557;models=a,b``.

        ``ranks=`` takes per-rank URLs separated by ``|`` (DP mode "urls").
        """
        head, *options = [part.strip() for part in text.strip().split(";") if part.strip()]
        values: dict[str, Any] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key.strip() not in _SPEC_KEYS:
                raise ValueError(f"bad worker option {option!r} in {text!r}")
            name = _SPEC_KEYS[key.strip()]
            value = value.strip()
            if name in ("dp_size", "bootstrap_port"):
                values[name] = int(value)
            elif name == "models":
                values[name] = [m for m in value.split(",") if m]
            elif name == "rank_urls":
                values[name] = [u for u in value.split("|") if u]
            else:
                values[name] = value
        return cls(url=head, **values)

    @classmethod
    def from_any(cls, item: str | dict[str, Any] | WorkerSpec) -> WorkerSpec:
        """A spec from the forms files and APIs carry: a spec string or a mapping."""
        if isinstance(item, WorkerSpec):
            return item
        if isinstance(item, str):
            return cls.parse(item)
        known = {k: v for k, v in item.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["role"] = str(self.role)
        return data


@dataclass(slots=True)
class RankLoad:
    """Load of one DP rank: router-side counts (this router plus shared peers) and engine view."""

    rank: int
    inflight: int
    prefill_tokens: int
    decode_seqs: int
    decode_tokens: int
    engine_running: int | None = None
    engine_waiting: int | None = None
    kv_usage: float | None = None


@dataclass(slots=True)
class Load:
    """The combined load model of a worker.

    ``requests`` is the best estimate of requests on the engine: the router's exact
    in-flight count, or the engine's own running+waiting plus what was sent since the
    last scrape when that is larger (other clients share the engine). ``score`` is
    what schedulers compare: requests, queued requests counted twice, KV pressure, all
    divided by the slow-start weight so a warming worker looks busier than it is.
    """

    inflight: int
    prefill_tokens: int
    decode_seqs: int
    decode_tokens: int
    engine_running: int | None
    engine_waiting: int | None
    kv_usage: float | None
    metrics_age: float | None
    stale: bool
    weight: float
    requests: float
    score: float


@dataclass(slots=True)
class RankCounters:
    """Router-side counters of one rank; ``remote_*`` are peers' counts read from Redis."""

    inflight: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_tokens: int = 0
    remote_inflight: int = 0
    remote_prefill_tokens: int = 0
    remote_decode_seqs: int = 0
    remote_decode_tokens: int = 0
    hidden_tokens: int = 0  # engine KV tokens beyond the router-side count, at the last scrape

    def local_tuple(self) -> tuple[int, int, int, int]:
        return (self.inflight, self.prefill_tokens, self.decode_seqs, self.decode_tokens)


@dataclass(slots=True)
class EngineSample:
    """Scraped engine metrics of one rank (or of the whole worker)."""

    running: int
    waiting: int
    kv_usage: float | None
    kv_tokens: int | None = None  # KV usage times capacity, when the engine says its capacity
    # The engine's TTFT histogram, summed over its series (the router's admission learns from it).
    ttft_sum: float | None = None
    ttft_count: float | None = None


@dataclass(slots=True)
class LoraSample:
    """The engine's LoRA adapters at the last scrape (vLLM's ``vllm:lora_requests_info``,
    its newest series): those running a request, those with requests waiting, and how
    many one step may run (its GPU slots)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int

    @property
    def free_slot(self) -> bool:
        """Room for one more adapter without evicting one in use (llm-d's reading)."""
        return len(set(self.running) | set(self.waiting)) < self.max_lora


class Worker:
    """Live state of one worker. Mutated only by the fleet that owns it."""

    def __init__(self, spec: WorkerSpec, settings: BalancerSettings, source: str = "static"):
        self.spec = spec
        self.id = spec.url
        self.url = spec.url
        self.models: set[str] = set(spec.models)
        # Of ``models``, the LoRA adapters (``/v1/models`` items with a ``parent``): name ->
        # base model.
        self.adapters: dict[str, str] = {}
        self.lora: LoraSample | None = None
        self.role = spec.role
        self.flavor = spec.flavor
        self.source = source
        self.inflight = 0
        self.local_inflight = 0
        self.healthy = True
        self.draining = False
        self.remove_when_idle = False
        self.ranks = [RankCounters() for _ in range(spec.dp_size)]
        self.totals = RankCounters()  # sums over ranks, kept in step so load() is O(1)
        self.engine: EngineSample | None = None
        self.engine_ranks: dict[int, EngineSample] = {}
        self.scraped_at: float | None = None
        self.sent_since_scrape = 0
        self.probe_failures = 0
        self.probe_successes = 0
        self.last_error: str | None = None
        self.breaker = Breaker(settings)
        self.outliers = OutlierWindow(settings.outlier_window)
        self.ejected_until = 0.0
        self.warm_since = time.monotonic()
        # When a request last began here, from any process of this router (monotonic, which
        # the processes of one host share): pickers rotate ties by it (``MaxScorePicker``).
        self.begun_at = 0.0
        # The router's hash-parity self-check of this worker (router.parity), when run.
        self.kv_parity: dict[str, Any] | None = None
        self._settings = settings
        self._rr = 0

    @property
    def circuit(self) -> str:
        return str(self.breaker.state)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def ejected(self) -> bool:
        return self.ejected_until > time.monotonic()

    def routable(self, now: float) -> bool:
        """Healthy, not draining, not ejected, and the breaker admits a request now."""
        if not self.healthy or self.draining or self.ejected_until > now:
            return False
        return self.breaker.state is Circuit.CLOSED or self.breaker.admits(now)

    def weight(self, now: float | None = None) -> float:
        """Slow-start weight in (0, 1]: ramps linearly after the worker (re)joined."""
        span = self._settings.slow_start_s
        if span <= 0:
            return 1.0
        elapsed = (time.monotonic() if now is None else now) - self.warm_since
        if elapsed >= span:
            return 1.0
        low = self._settings.slow_start_min_weight
        return low + (1.0 - low) * max(elapsed, 0.0) / span

    def engine_fresh(self, now: float) -> bool:
        return (
            self.scraped_at is not None
            and now - self.scraped_at <= self._settings.scrape_staleness_s
            and self.engine is not None
        )

    def rank_loads(self) -> list[RankLoad]:
        now = time.monotonic()
        fresh = self.engine_fresh(now)
        out = []
        for i, r in enumerate(self.ranks):
            sample = self.engine_ranks.get(i) if fresh else None
            out.append(
                RankLoad(
                    rank=i,
                    inflight=r.inflight + r.remote_inflight,
                    prefill_tokens=r.prefill_tokens + r.remote_prefill_tokens,
                    decode_seqs=r.decode_seqs + r.remote_decode_seqs,
                    decode_tokens=r.decode_tokens + r.remote_decode_tokens,
                    engine_running=sample.running if sample else None,
                    engine_waiting=sample.waiting if sample else None,
                    kv_usage=sample.kv_usage if sample else None,
                )
            )
        return out

    def queued_tokens(self) -> tuple[int, int]:
        """(prefill tokens queued, decode tokens plus sequences) across ranks and peers: the
        part of ``load()`` the KV-aware cost reads, without its clock read and 12-field
        record (``load()`` per candidate showed in a simulated kv_aware run over a
        thousand engines)."""
        t = self.totals
        return (
            t.prefill_tokens + t.remote_prefill_tokens,
            t.decode_tokens + t.remote_decode_tokens + t.decode_seqs + t.remote_decode_seqs,
        )

    def load(self) -> Load:
        now = time.monotonic()
        engine = self.engine
        scraped = self.scraped_at
        fresh = (
            engine is not None
            and scraped is not None
            and now - scraped <= self._settings.scrape_staleness_s
        )
        requests = float(self.inflight)
        running = waiting = None
        kv = None
        if fresh and engine is not None:
            running, waiting, kv = engine.running, engine.waiting, engine.kv_usage
            requests = max(requests, float(running + waiting + self.sent_since_scrape))
        weight = self.weight(now) if self._settings.slow_start_s > 0 else 1.0
        raw = requests + (waiting or 0) + self._settings.kv_usage_weight * (kv or 0.0)
        t = self.totals
        return Load(
            self.inflight,
            t.prefill_tokens + t.remote_prefill_tokens,
            t.decode_seqs + t.remote_decode_seqs,
            t.decode_tokens + t.remote_decode_tokens,
            running,
            waiting,
            kv,
            None if scraped is None else now - scraped,
            not fresh,
            weight,
            requests,
            raw / weight,
        )

    def describe(self) -> dict[str, Any]:
        """JSON-ready state for ``GET /v1/workers``."""
        load = self.load()
        return {
            "id": self.id,
            "url": self.url,
            "source": self.source,
            "spec": self.spec.to_dict(),
            "models": sorted(self.models),
            "adapters": dict(sorted(self.adapters.items())),
            "lora": None if self.lora is None else asdict(self.lora),
            "role": str(self.role),
            "flavor": self.flavor,
            "healthy": self.healthy,
            "draining": self.draining,
            "ejected": self.ejected,
            "circuit": self.circuit,
            "inflight": self.inflight,
            "local_inflight": self.local_inflight,
            "last_error": self.last_error,
            "load": asdict(load),
            "ranks": [asdict(r) for r in self.rank_loads()],
            "kv_parity": self.kv_parity,
        }


@dataclass(slots=True, eq=False)
class Ticket:
    """One request counted in-flight on a worker (and rank) until ``Fleet.end``."""

    worker: Worker
    rank: int
    prompt_tokens: int
    trial: bool = False
    decoding: bool = False
    generated: int = 0
    done: bool = False
    id: str = ""
    started: float = field(default_factory=time.monotonic)
    prefill_tokens: int = 0  # of prompt_tokens, those the engine must compute
