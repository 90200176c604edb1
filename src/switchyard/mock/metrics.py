"""``/metrics`` in the flavour's real Prometheus names, types, labels and buckets.

vLLM (v1 ``PrometheusStatLogger``): labels ``model_name`` and ``engine`` (the DP rank);
SGLang (``srt/metrics/collector.py``): labels ``model_name``, ``engine_type``,
``tp_rank``, ``pp_rank`` (plus ``dp_rank`` with DP). Gauges and token counters come
from the engine model's :class:`EngineStats` at scrape time; latency histograms are
observed by the server as it streams. Rendering is hand-written (no client library
locks on the hot path); ``tests/fixtures/metrics`` pins the names and types.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from switchyard.mock.engine.api import EngineStats

VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
VLLM_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
SGLANG_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
)
SGLANG_ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
SGLANG_E2E_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
    800.0,
)

# vLLM 0.32's per-request histograms (tests/fixtures/vllm_real/metrics.txt): name, help,
# buckets. Observed when a request finishes; iteration_tokens_total (per engine step) is
# exposed with no observations, as the engine steps are not seen from the server.
# Label sets of vllm:lora_requests_info kept (vLLM keeps all; a mock bounds them).
LORA_SERIES_KEPT = 64
VLLM_TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
VLLM_ITERATION_BUCKETS: tuple[float, ...] = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
VLLM_ITERATION_BUCKETS += (1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
VLLM_REQUEST_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("request_prompt_tokens", "Number of prefill tokens processed.", VLLM_TOKEN_BUCKETS),
    ("request_generation_tokens", "Number of generation tokens processed.", VLLM_TOKEN_BUCKETS),
    (
        "iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        VLLM_ITERATION_BUCKETS,
    ),
    (
        "request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        VLLM_TOKEN_BUCKETS,
    ),
    ("request_params_n", "Histogram of the n request parameter.", (1.0, 2.0, 5.0, 10.0, 20.0)),
    (
        "request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        VLLM_TOKEN_BUCKETS,
    ),
    (
        "request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        VLLM_ITL_BUCKETS,
    ),
    (
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        VLLM_E2E_BUCKETS,
    ),
    (
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        VLLM_E2E_BUCKETS,
    ),
    (
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        VLLM_E2E_BUCKETS,
    ),
    (
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        VLLM_E2E_BUCKETS,
    ),
    (
        "request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0),
    ),
    (
        "request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        VLLM_TOKEN_BUCKETS,
    ),
)


class Histogram:
    """Cumulative-bucket histogram for one label set."""

    __slots__ = ("buckets", "counts", "total", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def render(self, name: str, labels: str, out: list[str]) -> None:
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(running)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        out.append(f"{name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")


@dataclass
class RankMetrics:
    """What the server observes for one DP rank."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
    )
    requests: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(b) for name, _, b in VLLM_REQUEST_HISTOGRAMS}
    )
    remote_prefills: int = 0
    kv_pull_failures: int = 0
    kv_pulls_served: int = 0
    last_gen_tokens: int = 0
    last_scrape: float = field(default_factory=time.monotonic)


class EngineMetrics:
    def __init__(
        self,
        flavor: str,
        model: str,
        ranks: Sequence[int],
        role: str,
        dp_size: int,
        block_size: int,
        prefix_caching: bool,
        max_lora: int = 0,
    ) -> None:
        self.flavor = flavor
        # vLLM's lora_requests_info: one series per label set ever reported, its value the
        # time it was last reported (``set_to_current_time``); 0 when LoRA is off.
        self.max_lora = max_lora
        self.lora_series: dict[tuple[str, str], float] = {}
        self.model = model
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        vllm = flavor == "vllm"
        self.ranks: dict[int, RankMetrics] = {
            r: RankMetrics(
                Histogram(VLLM_TTFT_BUCKETS if vllm else SGLANG_TTFT_BUCKETS),
                Histogram(VLLM_ITL_BUCKETS if vllm else SGLANG_ITL_BUCKETS),
                Histogram(VLLM_E2E_BUCKETS if vllm else SGLANG_E2E_BUCKETS),
            )
            for r in ranks
        }
        if vllm:
            self._labels = {r: f'engine="{r}",model_name="{model}"' for r in ranks}
        else:
            engine_type = "unified" if role in ("unified", "encode") else role
            base = f'engine_type="{engine_type}",model_name="{model}",pp_rank="0",tp_rank="0"'
            self._labels = {r: (f'dp_rank="{r}",' + base) if dp_size > 1 else base for r in ranks}
        self.faults: dict[str, int] = {}

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def finished_request(
        self,
        rank: int,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        generated: int,
        max_tokens: int,
        ttft_s: float,
        e2e_s: float,
    ) -> None:
        """One finished request into vLLM's per-request histograms. The mock queues
        nothing before its engine step, so a request's queue time counts as 0 and its
        prefill time as its TTFT."""
        h = self.ranks[rank].requests
        decode_s = max(e2e_s - ttft_s, 0.0)
        for name, value in (
            ("request_prompt_tokens", prompt_tokens),
            ("request_generation_tokens", generated),
            ("request_max_num_generation_tokens", max_tokens),
            ("request_params_n", 1),
            ("request_params_max_tokens", max_tokens),
            ("request_queue_time_seconds", 0.0),
            ("request_inference_time_seconds", e2e_s),
            ("request_prefill_time_seconds", ttft_s),
            ("request_decode_time_seconds", decode_s),
            ("request_num_preemptions", 0),
            ("request_prefill_kv_computed_tokens", prompt_tokens - cached_tokens),
        ):
            h[name].observe(float(value))
        if generated > 1:
            h["request_time_per_output_token_seconds"].observe(decode_s / (generated - 1))

    def render(self, stats: dict[int, EngineStats]) -> bytes:
        out: list[str] = []
        if self.flavor == "vllm":
            self._render_vllm(stats, out)
        else:
            self._render_sglang(stats, out)
        self._render_mock(out)
        out.append("")
        return "\n".join(out).encode()

    def _family(
        self, out: list[str], name: str, kind: str, help_: str, values: dict[int, float]
    ) -> None:
        sample = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {sample if kind == 'counter' else name} {help_}")
        out.append(f"# TYPE {sample if kind == 'counter' else name} {kind}")
        for r, v in values.items():
            out.append(f"{sample}{{{self._labels[r]}}} {float(v)}")

    def _histograms(self, out: list[str], prefix: str, itl_name: str) -> None:
        families = (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
            (itl_name, "Histogram of inter-token latency in seconds.", "itl"),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
        )
        for suffix, help_, attr in families:
            name = f"{prefix}:{suffix}"
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            for r, m in self.ranks.items():
                getattr(m, attr).render(name, self._labels[r], out)

    def _render_vllm(self, stats: dict[int, EngineStats], out: list[str]) -> None:
        fam = self._family
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        for r, s in stats.items():
            out.append(
                f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
                f'enable_prefix_caching="{self.prefix_caching}",engine="{r}",'
                f'gpu_memory_utilization="0.9",num_gpu_blocks="{s.num_gpu_blocks}"}} 1.0'
            )
        fam(
            out,
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            {r: s.num_running for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            {r: s.num_waiting for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            {r: s.kv_cache_usage for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            {r: s.prefix_cache_queries for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            {r: s.prefix_cache_hits for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:num_preemptions",
            "counter",
            "Cumulative number of preemption from the engine.",
            {r: s.num_preemptions for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            {r: s.prompt_tokens_total for r, s in stats.items()},
        )
        fam(
            out,
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            {r: s.generation_tokens_total for r, s in stats.items()},
        )
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for r, m in self.ranks.items():
            for reason, n in m.finished.items():
                out.append(
                    f'vllm:request_success_total{{{self._labels[r]},finished_reason="{reason}"}}'
                    f" {float(n)}"
                )
        self._render_vllm_more(stats, out)
        if self.max_lora:
            self._render_lora(stats, out)
        self._histograms(out, "vllm", "inter_token_latency_seconds")
        for suffix, help_, _ in VLLM_REQUEST_HISTOGRAMS:
            name = f"vllm:{suffix}"
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            for r, m in self.ranks.items():
                m.requests[suffix].render(name, self._labels[r], out)

    def _render_lora(self, stats: dict[int, EngineStats], out: list[str]) -> None:
        """vLLM's ``vllm:lora_requests_info``: no engine label (its ranks overwrite each
        other's; here their adapters are merged), and every label set it reported stays,
        so a reader takes the series with the newest timestamp."""
        running = sorted({n for s in stats.values() for n in s.running_loras})
        waiting = sorted({n for s in stats.values() for n in s.waiting_loras})
        key = (",".join(waiting), ",".join(running))
        self.lora_series.pop(key, None)
        self.lora_series[key] = time.time()
        while len(self.lora_series) > LORA_SERIES_KEPT:
            del self.lora_series[next(iter(self.lora_series))]
        out.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
        out.append("# TYPE vllm:lora_requests_info gauge")
        for (w, r), at in self.lora_series.items():
            out.append(
                f'vllm:lora_requests_info{{max_lora="{self.max_lora}",'
                f'waiting_lora_adapters="{w}",running_lora_adapters="{r}"}} {at}'
            )

    def _labelled(
        self, out: list[str], name: str, kind: str, help_: str, values: dict[int, dict[str, float]]
    ) -> None:
        """A family with one extra label: ``values`` maps rank -> {"label=value": sample}."""
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for r, samples in values.items():
            for label, v in samples.items():
                key, val = label.split("=", 1)
                out.append(f'{name}{{{self._labels[r]},{key}="{val}"}} {float(v)}')

    def _render_vllm_more(self, stats: dict[int, EngineStats], out: list[str]) -> None:
        """The rest of vLLM 0.32's families (tests/fixtures/vllm_real/metrics.txt): the mock
        has no multimodal cache, KV connector, host/disk tiers, sleep mode or FLOP estimate,
        so those stay at vLLM-CPU's idle values; the cached tokens are all local."""
        fam, labelled = self._family, self._labelled
        zero = {r: 0.0 for r in stats}
        for name, help_ in (
            ("estimated_flops_per_gpu", "Estimated number of floating point operations per GPU."),
            ("estimated_read_bytes_per_gpu", "Estimated number of bytes read per GPU."),
            ("estimated_write_bytes_per_gpu", "Estimated number of bytes written per GPU."),
            ("external_prefix_cache_queries", "External prefix cache queries, in tokens."),
            ("external_prefix_cache_hits", "External prefix cache hits, in tokens."),
            ("mm_cache_queries", "Multi-modal cache queries, in items."),
            ("mm_cache_hits", "Multi-modal cache hits, in items."),
        ):
            fam(out, f"vllm:{name}", "counter", help_, zero)
        labelled(
            out,
            "vllm:num_requests_waiting_by_reason",
            "gauge",
            "Number of waiting requests by reason.",
            {r: {"reason=capacity": s.num_waiting, "reason=deferred": 0} for r, s in stats.items()},
        )
        labelled(
            out,
            "vllm:engine_sleep_state",
            "gauge",
            "Engine sleep state.",
            {
                r: {"sleep_state=awake": 1.0, "sleep_state=weights_offloaded": 0.0}
                | {"sleep_state=discard_all": 0.0}
                for r in stats
            },
        )
        labelled(
            out,
            "vllm:prompt_tokens_by_source_total",
            "counter",
            "Number of prompt tokens by source.",
            {
                r: {
                    "source=local_compute": s.prompt_tokens_total - s.prefix_cache_hits,
                    "source=local_cache_hit": s.prefix_cache_hits,
                    "source=external_kv_transfer": 0,
                }
                for r, s in stats.items()
            },
        )
        fam(
            out,
            "vllm:prompt_tokens_cached",
            "counter",
            "Number of cached prompt tokens (local + external).",
            {r: s.prefix_cache_hits for r, s in stats.items()},
        )
        tiers = ("host", "p2p", "disk", "external_unspecified")
        labelled(
            out,
            "vllm:prompt_tokens_cached_by_source_total",
            "counter",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            {
                r: {"source=device": s.prefix_cache_hits} | {f"source={t}": 0.0 for t in tiers}
                for r, s in stats.items()
            },
        )
        out.append(
            "# HELP vllm:admission_rejections_total Number of admission attempts rejected by a"
            " queue limit, by reason."
        )
        out.append("# TYPE vllm:admission_rejections_total counter")
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            labels = f'model_name="{self.model}",reason="{reason}"'
            out.append(f"vllm:admission_rejections_total{{{labels}}} 0.0")

    def _render_sglang(self, stats: dict[int, EngineStats], out: list[str]) -> None:
        fam = self._family
        fam(
            out,
            "sglang:max_total_num_tokens",
            "gauge",
            "Maximum total number of tokens in the KV cache pool.",
            {r: s.num_gpu_blocks * self.block_size for r, s in stats.items()},
        )
        now = time.monotonic()
        throughput: dict[int, float] = {}
        for r, s in stats.items():
            m = self.ranks[r]
            dt = now - m.last_scrape
            throughput[r] = (s.generation_tokens_total - m.last_gen_tokens) / dt if dt > 0 else 0.0
            m.last_gen_tokens, m.last_scrape = s.generation_tokens_total, now
        fam(
            out,
            "sglang:num_running_reqs",
            "gauge",
            "The number of running requests.",
            {r: s.num_running for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            {r: s.num_waiting for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:num_used_tokens",
            "gauge",
            "The number of used tokens.",
            {
                r: round(s.kv_cache_usage * s.num_gpu_blocks) * self.block_size
                for r, s in stats.items()
            },
        )
        fam(
            out,
            "sglang:token_usage",
            "gauge",
            "The token usage.",
            {r: s.kv_cache_usage for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:gen_throughput",
            "gauge",
            "The generation throughput (token/s).",
            throughput,
        )
        fam(
            out,
            "sglang:cache_hit_rate",
            "gauge",
            "The prefix cache hit rate.",
            {
                r: (s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
                for r, s in stats.items()
            },
        )
        fam(
            out,
            "sglang:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            {r: s.prompt_tokens_total for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            {r: s.generation_tokens_total for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:cached_tokens",
            "counter",
            "Number of cached prompt tokens.",
            {r: s.prefix_cache_hits for r, s in stats.items()},
        )
        fam(
            out,
            "sglang:num_requests",
            "counter",
            "The number of processed requests.",
            {r: s.requests_finished for r, s in stats.items()},
        )
        self._histograms(out, "sglang", "inter_token_latency_seconds")

    def _render_mock(self, out: list[str]) -> None:
        """Mock-only series (P/D transfers, injected faults), outside the engines' namespaces."""
        self._family(
            out,
            "mockengine_remote_prefills",
            "counter",
            "Requests decoded from KV pulled from a remote prefill.",
            {r: m.remote_prefills for r, m in self.ranks.items()},
        )
        self._family(
            out,
            "mockengine_kv_pulls_served",
            "counter",
            "Held prefill KV released to a decode engine's pull.",
            {r: m.kv_pulls_served for r, m in self.ranks.items()},
        )
        self._family(
            out,
            "mockengine_kv_pull_failures",
            "counter",
            "Remote-prefill pulls that failed (the prompt was recomputed locally).",
            {r: m.kv_pull_failures for r, m in self.ranks.items()},
        )
        out.append("# HELP mockengine_faults_injected_total Faults injected, by kind.")
        out.append("# TYPE mockengine_faults_injected_total counter")
        for kind, n in sorted(self.faults.items()):
            out.append(f'mockengine_faults_injected_total{{kind="{kind}"}} {float(n)}')
