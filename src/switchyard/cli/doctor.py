"""``switchyard doctor``: what the router will see of each worker, checked before it routes.

Per worker: its flavour and model, its KV block size, whether its KV events reach us
(vLLM's ``/kv_event_sources``), hash parity of our tokenizer and chat template with the
engine (the canary of ``router.parity``) and which of the metric names the balancer
reads it serves. Exit 0 when everything matches, 1 on any mismatch or unreachable
worker, 2 on a bad flag.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

from switchyard.balancer.scrape import KV_USAGE, RUNNING, SGLANG_CAPACITY, VLLM_CACHE_INFO, WAITING
from switchyard.kvstore.discovery import EventSource, fetch_sources, worker_url
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.loadtest.prom import labels_of, totals
from switchyard.net.control import async_client
from switchyard.router.parity import ParityChecker, ParityResult

# The load signals the balancer reads, each under the names either flavour may use.
SIGNALS: dict[str, tuple[str, ...]] = {
    "running": tuple(RUNNING),
    "waiting": tuple(WAITING),
    "kv usage": tuple(KV_USAGE),
    "kv capacity": (VLLM_CACHE_INFO, SGLANG_CAPACITY),
}


@dataclass
class Report:
    url: str
    reachable: bool = False
    error: str = ""
    flavor: str | None = None
    model: str | None = None
    block_size: int | None = None
    block_size_source: str = ""
    sources: list[EventSource] = field(default_factory=list)
    events_seen: bool = False
    parity: ParityResult | None = None
    metrics_seen: list[str] = field(default_factory=list)
    metrics_missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reachable and self.parity is not None and self.parity.ok is True

    def lines(self) -> list[str]:
        mark = "ok" if self.ok else "MISMATCH" if self.reachable else "UNREACHABLE"
        out = [f"{self.url}: {mark}"]
        if not self.reachable:
            return [*out, f"  error:        {self.error}"]
        out.append(f"  flavour:      {self.flavor or 'unknown'}")
        out.append(f"  model:        {self.model or 'none listed'}")
        size = f"{self.block_size} ({self.block_size_source})" if self.block_size else "unknown"
        out.append(f"  block size:   {size}")
        if self.sources:
            eps = ", ".join(f"rank {s.dp_rank} {s.endpoint}" for s in self.sources)
            seen = "events received" if self.events_seen else "NO events received"
            out.append(f"  KV events:    {eps}; {seen}")
        else:
            out.append("  KV events:    none listed (no /kv_event_sources or events off)")
        p = self.parity
        if p is None:
            out.append("  parity:       not checked")
        else:
            verdict = "MISMATCH: " if p.ok is False else "undecided: " if p.ok is None else ""
            cause = f"; likely cause: {p.cause}" if p.cause else ""
            out.append(f"  parity:       {verdict}{p.reason}{cause}")
            out.append(
                f"                canary {p.router_tokens} tokens (engine counts "
                f"{p.engine_prompt_tokens}), published {p.event_tokens}, predicted cached "
                f"{p.predicted_cached_tokens}, engine cached {p.engine_cached_tokens}"
            )
        seen = ", ".join(self.metrics_seen) or "none"
        out.append(f"  metrics seen: {seen}")
        if self.metrics_missing and self.flavor:
            out.append(f"  load signals missing: {', '.join(self.metrics_missing)}")
        return out


# Each of doctor's own requests, phase by phase (the parity canary has its own).
_TIMEOUT_S = 10.0


async def _get_json(client: httpx.AsyncClient, url: str) -> object:
    r = await client.get(url, timeout=_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


async def examine(
    client: httpx.AsyncClient,
    url: str,
    tokenizer: RoutingTokenizer | None,
    block_size: int,
    events_wait_s: float,
) -> Report:
    """Everything ``doctor`` says about one worker."""
    report = Report(url)
    try:
        models = await _get_json(client, url + "/v1/models")
        r = await client.get(url + "/metrics", timeout=_TIMEOUT_S)
        metrics = r.text if r.status_code == 200 else ""
    except (httpx.HTTPError, ValueError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        return report
    report.reachable = True
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        report.model = str(data[0].get("id"))
    names = set(totals(metrics))
    report.flavor = "vllm" if any(n.startswith("vllm:") for n in names) else None
    if report.flavor is None and any(n.startswith("sglang:") for n in names):
        report.flavor = "sglang"
    prefix = f"{report.flavor}:" if report.flavor else ""
    report.metrics_seen = sorted(n for group in SIGNALS.values() for n in group if n in names)
    report.metrics_missing = [
        signal
        for signal, group in SIGNALS.items()
        if not any(n in names for n in group if n.startswith(prefix))
    ]
    info = labels_of(metrics, VLLM_CACHE_INFO)
    if info and info[0].get("block_size", "").isdigit():
        report.block_size, report.block_size_source = int(info[0]["block_size"]), "metrics"
    report.sources = await fetch_sources(client, url) or []
    if report.model is None:
        return report
    store = KVStore(
        block_size=report.block_size or block_size,
        tokenizer=tokenizer or RoutingTokenizer.from_engine(url),
    )
    follower = store.follow_workers([url])
    await store.start()
    try:
        await follower.wait()
        # A SUB socket drops what is published before its connection completes.
        await asyncio.sleep(0.5)
        checker = ParityChecker(store, events_wait_s=events_wait_s)
        report.parity = await checker.check(client, url, report.model)
        learned = store.instance_block_sizes.get(url)
        report.events_seen = learned is not None
        if learned is not None:
            source = "events" if report.block_size in (None, learned) else "events; metrics say "
            if report.block_size not in (None, learned):
                source += str(report.block_size)
            report.block_size, report.block_size_source = learned, source
    finally:
        await store.stop()
    return report


async def diagnose(
    urls: list[str], tokenizer_dir: str | None, block_size: int, events_wait_s: float
) -> list[Report]:
    tokenizer = RoutingTokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
    async with async_client() as client:
        return [await examine(client, u, tokenizer, block_size, events_wait_s) for u in urls]


def _tokenizer_dir(value: str | None) -> str | None:
    if value is None:
        return None
    if not (Path(value) / "tokenizer.json").is_file():
        raise click.BadParameter(f"{value!r} has no tokenizer.json", param_hint="--tokenizer")
    return value


def command() -> click.Command:
    default_block = KVStoreSettings.model_fields["block_size"].default

    def callback(
        worker: tuple[str, ...], tokenizer: str | None, block_size: int, events_wait_s: float
    ) -> None:
        try:
            urls = [worker_url(w) for w in worker]
        except ValueError as exc:
            raise click.BadParameter(str(exc).split(": ", 1)[-1], param_hint="--worker") from None
        reports = asyncio.run(diagnose(urls, _tokenizer_dir(tokenizer), block_size, events_wait_s))
        for report in reports:
            click.echo("\n".join(report.lines()))
        bad = [r.url for r in reports if not r.ok]
        click.echo(f"{len(reports) - len(bad)} of {len(reports)} workers ok")
        raise click.exceptions.Exit(1 if bad else 0)

    return click.Command(
        "doctor",
        callback=callback,
        help="Check each worker as the router will use it: flavour, model, block size, KV "
        "events, hash parity of the tokenizer and chat template, metric names. Exit 0 when "
        "all match, 1 otherwise.",
        params=[
            click.Option(
                ["--worker", "-w"], multiple=True, required=True, help="Worker URL, repeatable."
            ),
            click.Option(
                ["--tokenizer"],
                help="HF tokenizer dir the router will use (default: the engine's /tokenize).",
            ),
            click.Option(
                ["--block-size"],
                type=click.IntRange(min=1),
                default=default_block,
                show_default=True,
                help="Block size assumed until the engine's metrics or events tell its own.",
            ),
            click.Option(
                ["--events-wait-s"],
                type=click.FloatRange(min=0),
                default=5.0,
                show_default=True,
                help="How long to wait for the canary's KV events.",
            ),
        ],
    )
