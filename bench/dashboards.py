"""The shipped Grafana dashboard, Prometheus rules and autoscalers' queries, evaluated on a
real Prometheus.

A stack on loopback: one ``mock-fleet`` process (a prefill, a decode and three unified
engines with KV events), the balancer and kvstore services, and four routers: one in
services mode on those two (flow control capped at one request per worker, SLO
admission on), one embedding its balancer and kvstore (KV-aware, with a hash-parity check
and an engine that answers 503), one P/D router, and one whose only worker never answers.
Load goes through each (a flood for the queue, a prefill leg that fails, a KV-event gap),
then ``prometheus`` scrapes all of them every second with ``deploy/prometheus/alerts.yaml``
loaded, and every panel expression, every rule expression and each query the KEDA and
prometheus-adapter examples would send is queried: the table shows how many series each
returns.

``python -m bench.dashboards`` prints the table (needs ``prometheus`` on the PATH);
``tests/deploy/test_prometheus_live.py`` runs the same and asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from switchyard.loadtest.procs import Server, free_port, free_port_block, wait_http
from switchyard.mock.settings import DEFAULT_TOKENIZER

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "switchyard-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
AUTOSCALING = REPO / "deploy" / "kubernetes" / "autoscaling"
SHIPPED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # what the manifests serve
MODEL = "mock-model"
RATE_INTERVAL = "30s"
# What a flood must have shown Prometheus: requests queued, in the scrape and in the
# recording rule (evaluated on its own clock, so it can miss a short queue), and a model
# saturated.
FLOOD_SEEN = (
    "max_over_time(switchyard_router_model_queued[5m]) > 0",
    "max_over_time(switchyard:model_queued:sum[5m]) > 0",
    'max_over_time(switchyard_router_model_saturation{role="unified"}[5m]) == 1',
    "last_over_time(switchyard_router_flow_saturated_models[5m])",
)
START_S = 90.0  # a process may start slowly on a loaded machine

# Expressions over counters that only a rare event creates, which this stack does not
# provoke: each is still checked to parse and to name a metric family Prometheus scraped.
EVENT_ONLY = {
    "switchyard_router_pd_aborts_total": "a leg aborted because the other leg failed",
    "switchyard_kvstore_replays_total": "a gap on a publisher with a replay socket",
    "switchyard_kvstore_backend_errors_total": "a Redis backend call that failed",
}


@dataclass(frozen=True)
class Expression:
    """One query the shipped files make: a panel target, a rule or an autoscaler's."""

    kind: str  # panel, record, alert, keda or adapter
    title: str  # panel title (with the target's legend) or rule name
    expr: str  # as shipped
    query: str  # as sent to Prometheus (Grafana's variables replaced)


@dataclass(frozen=True)
class Result:
    expression: Expression
    series: int
    error: str | None = None

    @property
    def names(self) -> set[str]:
        return metric_names(self.expression.query)


def grafana_to_promql(expr: str) -> str:
    """A panel's expression as Prometheus can run it: the range variables become
    ``RATE_INTERVAL``, any template variable matches everything."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", RATE_INTERVAL, expr)
    expr = re.sub(r"\[\[\w+\]\]|\$\{\w+(?::\w+)?\}|\$\w+", ".*", expr)
    return expr


_NAME = re.compile(r"\b(switchyard_[a-z0-9_]+|switchyard:[a-z0-9_:]+)")


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def panel_expressions(path: Path = DASHBOARD) -> list[Expression]:
    dashboard = json.loads(path.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                legend = target.get("legendFormat", "")
                title = f"{panel['title']} [{legend}]" if legend else panel["title"]
                found.append(Expression("panel", title, expr, grafana_to_promql(expr)))
    return found


def rule_expressions(path: Path = RULES) -> list[Expression]:
    found = []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            kind = "alert" if "alert" in rule else "record"
            name = rule.get("alert") or rule["record"]
            found.append(Expression(kind, name, rule["expr"], rule["expr"]))
    return found


def autoscaler_expressions(directory: Path = AUTOSCALING) -> list[Expression]:
    """The queries KEDA and prometheus-adapter would send for the shipped manifests, with
    the stack's model in place of the manifests' (an HPA's selector becomes the adapter's
    label matchers)."""
    found = []
    keda = yaml.safe_load((directory / "keda-engines.yaml").read_text())
    for trigger in keda["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        found.append(
            Expression("keda", trigger["name"], query, query.replace(SHIPPED_MODEL, MODEL))
        )
    adapter = yaml.safe_load((directory / "prometheus-adapter.yaml").read_text())
    rules = {r["name"]["as"]: r for r in adapter["externalRules"]}
    hpa = yaml.safe_load((directory / "hpa-engines.yaml").read_text())
    for metric in hpa["spec"]["metrics"]:
        ident = metric["external"]["metric"]
        rule = rules[ident["name"]]
        labels = {**ident["selector"]["matchLabels"], "model": MODEL}
        series = re.fullmatch(r'\{__name__="([^"]+)"\}', rule["seriesQuery"])
        assert series is not None, rule["seriesQuery"]
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series.group(1))
            .replace("<<.LabelMatchers>>", ",".join(f'{k}="{v}"' for k, v in labels.items()))
        )
        found.append(Expression("adapter", ident["name"], rule["metricsQuery"], query))
    return found


# -- the stack -----------------------------------------------------------------------------


class Stack:
    """The processes on loopback; ``targets`` is what Prometheus scrapes, by job."""

    def __init__(self, tmp: Path, speed: float = 20.0) -> None:
        self.tmp = tmp
        self.speed = speed
        self.fleet_port = free_port_block(5)
        self.events_port = free_port_block(5)
        self.prefill, self.decode, *self.unified = [
            f"http://127.0.0.1:{self.fleet_port + i}" for i in range(5)
        ]
        self.healthy, self.faulty = self.unified[:2], self.unified[2]
        self.events = {
            url: f"tcp://127.0.0.1:{self.events_port + 2 + i}" for i, url in enumerate(self.unified)
        }
        self.dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        self.ports = {
            name: free_port()
            for name in ("balancer", "kvstore", "services", "embedded", "pd", "unroutable")
        }
        self.servers: list[Server] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    @property
    def targets(self) -> dict[str, list[str]]:
        ports = self.ports
        return {
            "switchyard-router": [
                f"127.0.0.1:{ports[n]}" for n in ("services", "embedded", "pd", "unroutable")
            ],
            "switchyard-balancer": [f"127.0.0.1:{ports['balancer']}"],
            "switchyard-kvstore": [f"127.0.0.1:{ports['kvstore']}"],
            "engines": [f"127.0.0.1:{self.fleet_port + i}" for i in range(5)],
        }

    def _start(self, args: list[str], port: int, health_path: str = "/health") -> None:
        server = Server(args, port, health_path, start_timeout_s=START_S)
        self.servers.append(server)
        server.start()

    def start(self) -> None:
        tok = DEFAULT_TOKENIZER
        one = ["--processes", "1"]
        self._start(
            [
                "mock-fleet",
                *("--count", "5", "--prefill", "1", "--decode", "1"),
                *("--base-port", str(self.fleet_port)),
                *("--kv-events-base-port", str(self.events_port)),
                *("--num-gpu-blocks", "256", "--speed", str(self.speed)),
            ],
            self.fleet_port + 4,
        )
        for url in self.unified:
            wait_http(url + "/health", START_S)
        workers = [a for url in self.healthy for a in ("-w", url)]
        subscribe = [
            a for url in self.healthy for a in ("--subscribe", f"{url}={self.events[url]}")
        ]
        p = self.ports
        self._start(["balancer", "--port", str(p["balancer"]), *workers], p["balancer"])
        self._start(
            ["kvstore", "--port", str(p["kvstore"]), "--tokenizer", tok, *subscribe], p["kvstore"]
        )
        self._start(
            [
                *("router", "--port", str(p["services"]), *one, "--tokenizer", tok),
                *("--balancer", self.url("balancer"), "--kvstore", self.url("kvstore")),
                *("--flow-max-inflight-per-worker", "1", "--admission-slo-ttft-ms", "60000"),
            ],
            p["services"],
        )
        events = [a for url in self.healthy for a in ("--kv-events", f"{url}={self.events[url]}")]
        self._start(
            [
                *("router", "--port", str(p["embedded"]), *one, "--tokenizer", tok),
                *workers,
                *("-w", self.faulty),
                *events,
            ],
            p["embedded"],
        )
        self._start(
            [
                *("router", "--port", str(p["pd"]), *one, "--pd-protocol", "vllm"),
                *("--prefill", self.prefill, "--decode", self.decode),
            ],
            p["pd"],
        )
        self._start(
            ["router", "--port", str(p["unroutable"]), *one, "-w", self.dead], p["unroutable"]
        )

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    # -- load ------------------------------------------------------------------------------

    def drive(self) -> None:
        """Traffic that makes every series the dashboard and rules read exist."""
        with httpx.Client(timeout=60) as client:
            # no routable worker: a 503 now and more after the flood, so that Prometheus
            # scrapes the counter between them (a rate needs two samples of it)
            chat(client, self.url("unroutable"), "refused")
            for name in ("services", "embedded", "pd"):
                for turn in range(4):
                    chat(client, self.url(name), f"turn {turn}", stream=turn % 2 == 1)
            # an engine that answers 503: the embedded router retries elsewhere
            faults(client, self.faulty, {"error_rate": 1.0, "error_codes": [503]})
            for turn in range(6):
                chat(client, self.url("embedded"), f"retry {turn}")
            # a prefill leg that fails: the P/D router falls back to its decode worker
            faults(client, self.prefill, {"error_rate": 1.0})
            for turn in range(3):
                chat(client, self.url("pd"), f"fallback {turn}")
            faults(client, self.prefill, {"error_rate": 0.0})
            # a KV-event sequence gap on one engine: the kvstores clear what it told them
            faults(client, self.healthy[1], {"kv_gap": 3})
            for turn in range(3):
                chat(client, self.url("embedded"), f"gap {turn} " * 40)

    def refuse(self, count: int) -> None:
        """Requests the router without workers answers 503."""
        with httpx.Client(timeout=60) as client:
            for turn in range(count):
                chat(client, self.url("unroutable"), f"refused {turn}")

    def flood(self, seen: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Streams against one request per worker, round after round, until ``seen()``
        (Prometheus scraped the router while requests queued): the queue fills and drains."""
        stop = threading.Event()

        def flood(i: int) -> int:
            text = f"flood {i}"
            return chat(client, self.url("services"), text, stream=True, max_tokens=200)

        def rounds() -> None:
            while not stop.is_set():
                list(pool.map(flood, range(32)))

        with ThreadPoolExecutor(17) as pool, httpx.Client(timeout=60) as client:
            running = pool.submit(rounds)
            deadline = time.monotonic() + timeout_s
            try:
                while not seen():
                    if time.monotonic() > deadline:
                        raise TimeoutError("Prometheus never saw a request queued")
                    if running.done():
                        running.result()  # the flood failed: its error
                    time.sleep(0.5)
            finally:
                stop.set()
            running.result()


def chat(
    client: httpx.Client, base: str, text: str, stream: bool = False, max_tokens: int = 16
) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    with client.stream("POST", base + "/v1/chat/completions", json=body) as answer:
        answer.read()
        return answer.status_code


def faults(client: httpx.Client, engine: str, values: dict[str, Any]) -> None:
    client.post(engine + "/admin/faults", json=values).raise_for_status()


# -- Prometheus ----------------------------------------------------------------------------


class Prometheus:
    """``prometheus`` on loopback scraping ``targets`` every second, with ``rules``."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]], rules: Path = RULES) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            raise RuntimeError("prometheus is not on the PATH")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.argv = [
            exe,
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.log = tmp / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url + "/-/ready", START_S, self.proc)
        except Exception as exc:
            self.stop()
            raise RuntimeError(
                f"prometheus failed: {exc}\n{self.log.read_text()[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def api(self, path: str, **params: str) -> Any:
        answer = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = answer.json()
        if body.get("status") != "success":
            raise PromQLError(body.get("error", answer.text))
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] in ("vector", "matrix") else [result]

    def wait_for_scrapes(self, scrapes: int = 5, timeout_s: float = 60.0) -> None:
        """Until every target is up and has been scraped ``scrapes`` times since now."""
        deadline = time.monotonic() + timeout_s
        since = time.time()
        while time.monotonic() < deadline:
            targets = self.api("targets")["activeTargets"]
            if targets and all(t["health"] == "up" for t in targets):
                break
            time.sleep(0.5)
        else:
            down = [(t["scrapeUrl"], t["lastError"]) for t in targets if t["health"] != "up"]
            raise TimeoutError(f"targets not up: {down}")
        time.sleep(max(0.0, since + scrapes - time.time()))

    def known_names(self) -> set[str]:
        """Metric families Prometheus read a TYPE line for (samples or not)."""
        return set(self.api("metadata"))


class PromQLError(Exception):
    """Prometheus refused a query."""


def evaluate(prometheus: Prometheus, expressions: list[Expression]) -> list[Result]:
    results = []
    for expression in expressions:
        try:
            results.append(Result(expression, len(prometheus.query(expression.query))))
        except PromQLError as exc:
            results.append(Result(expression, 0, str(exc)))
    return results


def table(results: list[Result]) -> str:
    rows = [("kind", "panel / rule", "series", "expression")]
    for r in results:
        series = f"error: {r.error}" if r.error else str(r.series)
        if not r.series and not r.error and r.names & set(EVENT_ONLY):
            series = "0 (event only)"
        query = " ".join(r.expression.query.split())
        rows.append((r.expression.kind, r.expression.title, series, query))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for row in rows:
        lines.append(
            " | ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + " | " + row[3]
        )
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 10)
    return "\n".join(lines)


@contextlib.contextmanager
def running(tmp: Path, speed: float = 20.0) -> Iterator[tuple[Stack, Prometheus]]:
    """The stack started and driven, and a Prometheus that has scraped it a few times."""
    stack = Stack(tmp, speed)
    prometheus = Prometheus(tmp, stack.targets)
    try:
        stack.start()
        prometheus.start()
        prometheus.wait_for_scrapes(1)  # counters born from now on are seen rising
        stack.drive()
        stack.flood(lambda: all(prometheus.query(q) for q in FLOOD_SEEN))
        stack.refuse(3)
        prometheus.wait_for_scrapes()
        yield stack, prometheus
    finally:
        prometheus.stop()
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=20.0, help="mock engines' speed")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, running(Path(tmp), args.speed) as (_, prom):
        results = evaluate(
            prom, panel_expressions() + rule_expressions() + autoscaler_expressions()
        )
    print(table(results))
    # an alert's condition may rightly be false: only a query that fails counts there
    failed = [
        r
        for r in results
        if r.error
        or (r.expression.kind != "alert" and not r.series and not r.names & set(EVENT_ONLY))
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
