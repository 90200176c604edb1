"""Reading an engine's Prometheus ``/metrics`` text into the few numbers the load model uses.

vLLM and SGLang name the same gauges differently; the names also tell us which
engine we talk to when the config does not say.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from balancer.worker import EngineSample

RUNNING = {"vllm:num_requests_running": "vllm", "sglang:num_running_reqs": "sglang"}
WAITING = {"vllm:num_requests_waiting": "vllm", "sglang:num_queue_reqs": "sglang"}
KV_USAGE = {
    "vllm:kv_cache_usage_perc": "vllm",
    "vllm:gpu_cache_usage_perc": "vllm",
    "sglang:token_usage": "sglang",
}
# KV capacity in tokens: vLLM puts it in labels of an info gauge, SGLang in a gauge.
VLLM_CACHE_INFO = "vllm:cache_config_info"
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
# The engine's own TTFT histogram (same family name in both), for the router's admission.
TTFT_SUM = {"vllm:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_sum"}
TTFT_COUNT = {
    "vllm:time_to_first_token_seconds_count",
    "sglang:time_to_first_token_seconds_count",
}
RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")


@dataclass
class Scrape:
    flavor: str | None = None
    total: EngineSample | None = None
    ranks: dict[int, EngineSample] = field(default_factory=dict)


def _vllm_capacity(labels: dict[str, str]) -> float | None:
    try:
        return float(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    except (KeyError, ValueError):
        return None


def _rank_of(labels: dict[str, str]) -> int | None:
    for key, value in labels.items():
        if key in RANK_LABELS:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _samples(text: str) -> Iterator[Sample]:
    """The exposition's samples; a malformed line ends the scrape with what came before."""
    try:
        for family in text_string_to_metric_families(text):
            yield from family.samples
    except ValueError:
        return


def parse_metrics(text: str) -> Scrape:
    """Sum running/waiting over series, average KV usage; split per DP rank when labelled."""
    flavor: str | None = None
    sums: dict[tuple[str, int | None], float] = {}
    counts: dict[tuple[str, int | None], int] = {}
    for found in _samples(text):
        name = found.name
        if name in RUNNING:
            kind, flavor = "running", flavor or RUNNING[name]
        elif name in WAITING:
            kind, flavor = "waiting", flavor or WAITING[name]
        elif name in KV_USAGE:
            kind, flavor = "kv", flavor or KV_USAGE[name]
        elif name == SGLANG_CAPACITY:
            kind, flavor = "capacity", flavor or "sglang"
        elif name == VLLM_CACHE_INFO:
            kind, flavor = "capacity", flavor or "vllm"
        elif name in TTFT_SUM:
            kind = "ttft_sum"
        elif name in TTFT_COUNT:
            kind = "ttft_count"
        else:
            if flavor is None and name.startswith(("vllm:", "sglang:")):
                flavor = name.split(":", 1)[0]
            continue
        value = found.value
        if name == VLLM_CACHE_INFO:
            capacity = _vllm_capacity(found.labels)
            if capacity is None:
                continue
            value = capacity
        rank = _rank_of(found.labels)
        for key in ((kind, None), (kind, rank)) if rank is not None else ((kind, None),):
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1

    def sample(rank: int | None) -> EngineSample | None:
        if ("running", rank) not in sums and ("waiting", rank) not in sums:
            return None
        kv_n = counts.get(("kv", rank), 0)
        kv = sums[("kv", rank)] / kv_n if kv_n else None
        capacity = sums.get(("capacity", rank))
        return EngineSample(
            running=int(sums.get(("running", rank), 0.0)),
            waiting=int(sums.get(("waiting", rank), 0.0)),
            kv_usage=kv,
            kv_tokens=round(kv * capacity) if kv is not None and capacity else None,
            ttft_sum=sums.get(("ttft_sum", rank)),
            ttft_count=sums.get(("ttft_count", rank)),
        )

    ranks = {r: s for r in {k[1] for k in sums if k[1] is not None} if (s := sample(r))}
    return Scrape(flavor=flavor, total=sample(None), ranks=ranks)
