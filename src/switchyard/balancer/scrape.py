"""Reading an engine's Prometheus ``/metrics`` text into the few numbers the load model uses.

vLLM and SGLang name the same gauges differently; the names also tell us which
engine we talk to when the config does not say.

Only the lines of the families below reach prometheus_client's parser, one memoised
series at a time (the value is read here), so the cost does not grow with the histogram
buckets and families an engine adds: a whole scrape through the parser was a large share
of the router's CPU on the multi-turn replay (see docs/benchmarks.md, router_cpu), and one
regex scan with the values read here is a fraction of a filtered, line-by-line parse.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from switchyard.balancer.worker import EngineSample, LoraSample

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
# vLLM's LoRA info gauge: adapters in its labels, the time it was set as its value; every
# label set it ever set stays, so the newest series is the current one.
LORA_INFO = "vllm:lora_requests_info"
RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")
# The families whose sample lines go to the parser.
WANTED = tuple(
    sorted(
        {
            *RUNNING,
            *WAITING,
            *KV_USAGE,
            VLLM_CACHE_INFO,
            SGLANG_CAPACITY,
            *TTFT_SUM,
            *TTFT_COUNT,
            LORA_INFO,
        }
    )
)
FLAVORS = ("vllm:", "sglang:")


@dataclass
class Scrape:
    flavor: str | None = None
    total: EngineSample | None = None
    ranks: dict[int, EngineSample] = field(default_factory=dict)
    lora: LoraSample | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Scrape:
        """A scrape as orjson wrote it (``OPT_NON_STR_KEYS``: rank keys as strings), the
        form the processes of one router share it in."""
        total = data["total"]
        lora = data.get("lora")
        return cls(
            flavor=data["flavor"],
            total=None if total is None else EngineSample(**total),
            ranks={int(rank): EngineSample(**sample) for rank, sample in data["ranks"].items()},
            lora=None
            if lora is None
            else LoraSample(tuple(lora["running"]), tuple(lora["waiting"]), lora["max_lora"]),
        )


def _vllm_capacity(labels: dict[str, str]) -> float | None:
    try:
        return float(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    except (KeyError, ValueError):
        return None


def _lora(labels: dict[str, str]) -> LoraSample | None:
    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in labels.get(key, "").split(",") if n)

    try:
        max_lora = int(labels["max_lora"])
    except (KeyError, ValueError):
        return None
    return LoraSample(names("running_lora_adapters"), names("waiting_lora_adapters"), max_lora)


def _rank_of(labels: dict[str, str]) -> int | None:
    for key, value in labels.items():
        if key in RANK_LABELS:
            try:
                return int(value)
            except ValueError:
                return None
    return None


_FLAVOR = re.compile(r"^(vllm|sglang):", re.M)


# The wanted families' sample lines, in the text's order, found by one regex scan of the
# text rather than a Python loop over its lines, which costs about twice as much on a
# mock engine's scrape. A line starts after a newline (the
# text gets one in front); a longer name sharing a prefix is not matched. A name that
# pairs one flavor's prefix with the other's suffix is matched, parsed, and ignored.
_WANTED_LINE = re.compile(
    r"\n((?:vllm:|sglang:)(?:"
    + "|".join(sorted({re.escape(name.split(":", 1)[1]) for name in WANTED}))
    + r")(?=[{ \t])[^\r\n]*)"
)


@lru_cache(maxsize=1024)
def _parse_line(line: str) -> tuple[Sample, ...]:
    """One sample line through the parser, memoised."""
    return tuple(s for family in text_string_to_metric_families(line) for s in family.samples)


def _sample(line: str) -> Iterator[Sample]:
    """The sample of one line: its series (name and labels) from the parser, memoised,
    and its value read here. An engine repeats its series between scrapes and moves
    their values: a whole changed line through the parser is slow, and the load lines
    change on every scrape under traffic. A line with a timestamp goes whole."""
    end = line.rfind("}") + 1 or line.find(" ")
    value = line[end:].split()
    if end <= 0 or len(value) != 1:
        yield from _parse_line(line)
        return
    for series in _parse_line(line[:end] + " 0"):
        yield Sample(series.name, series.labels, float(value[0]))


def _samples(lines: list[str]) -> Iterator[Sample]:
    """The samples of ``lines``; a malformed one ends the scrape with what came before."""
    try:
        for line in lines:
            yield from _sample(line)
    except ValueError:
        return


def _flavor(text: str) -> str | None:
    """The engine named by the first ``vllm:`` or ``sglang:`` sample."""
    found = _FLAVOR.search(text)
    return found.group(1) if found else None


def parse_metrics(text: str) -> Scrape:
    """Sum running/waiting over series, average KV usage; split per DP rank when labelled.

    A malformed line among the wanted ones ends the reading with what came before it;
    lines of other families are never parsed, so they cannot break it.
    """
    flavor = _flavor(text)
    sums: dict[tuple[str, int | None], float] = {}
    counts: dict[tuple[str, int | None], int] = {}
    lora: LoraSample | None = None
    lora_at = float("-inf")
    for found in _samples(_WANTED_LINE.findall("\n" + text)):
        name = found.name
        if name == LORA_INFO:
            if found.value > lora_at and (parsed := _lora(found.labels)) is not None:
                lora, lora_at = parsed, found.value
            continue
        if name in RUNNING:
            kind = "running"
        elif name in WAITING:
            kind = "waiting"
        elif name in KV_USAGE:
            kind = "kv"
        elif name in (SGLANG_CAPACITY, VLLM_CACHE_INFO):
            kind = "capacity"
        elif name in TTFT_SUM:
            kind = "ttft_sum"
        elif name in TTFT_COUNT:
            kind = "ttft_count"
        else:
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
    return Scrape(flavor=flavor, total=sample(None), ranks=ranks, lora=lora)
