"""Hash-parity self-check: a canary per worker says whether the router keys prompts as the
engine caches them, and names the likely cause when not (mock engines with real events)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from switchyard.balancer.siblings import SiblingBus
from switchyard.cli.main import run
from switchyard.kvstore.ingest import StoredTokens
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.parity import (
    PARITY,
    ParityChecker,
    ParityMonitor,
    ParityResult,
    event_chain,
    likely_cause,
)
from tests.support import TOKENIZER_DIR, Server, free_port

pytestmark = pytest.mark.timeout(120)


def tokenizer_variant(tmp: Path, name: str, template: str) -> Path:
    """A copy of the project's tokenizer whose chat template is ``template``."""
    out = tmp / name
    shutil.copytree(TOKENIZER_DIR, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def original_template() -> str:
    return str(json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())["chat_template"])


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, str]]:
    """A vLLM mock with KV events (block size 32) and one without events."""
    started: list[Server] = []
    try:
        port = free_port()
        argv = ["mock", "--port", str(port), "--model", "m", "--speed", "100"]
        events = [*argv, "--kv-events-port", str(free_port()), "--block-size", "32"]
        started.append(Server(events, port).start())
        quiet = free_port()
        started.append(Server(["mock", "--port", str(quiet), "--model", "m"], quiet).start())
        yield {"events": started[0].url, "quiet": started[1].url}
    finally:
        for server in started:
            server.stop()


def check(url: str, tokenizer_dir: Path) -> tuple[ParityResult, dict[str, int]]:
    """One parity check of ``url`` from a store that discovered its events by itself."""

    async def go() -> tuple[ParityResult, dict[str, int]]:
        store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(tokenizer_dir))
        follower = store.follow_workers([url])
        await store.start()
        try:
            await follower.wait()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient() as client:
                result = await ParityChecker(store).check(client, url, "m")
            return result, dict(store.instance_block_sizes)
        finally:
            await store.stop()

    return asyncio.run(go())


def test_matching_tokenizer_and_template_are_verified_in_the_engines_block_size(
    mocks: dict[str, str],
) -> None:
    result, sizes = check(mocks["events"], TOKENIZER_DIR)
    assert result.ok is True, result
    assert sizes == {mocks["events"]: 32}
    assert result.block_size == 32
    full = result.router_tokens // 32 * 32
    assert result.event_tokens == full == result.predicted_cached_tokens
    assert result.engine_cached_tokens is not None
    assert abs(result.engine_cached_tokens - result.predicted_cached_tokens) <= 32


def test_a_different_chat_template_is_a_mismatch_named_as_such(
    mocks: dict[str, str], tmp_path: Path
) -> None:
    other = original_template().replace("message['role'] + '\\n'", "message['role'] + ':\\n'")
    assert other != original_template()
    result, _ = check(mocks["events"], tokenizer_variant(tmp_path, "colon", other))
    assert result.ok is False
    assert result.cause == "chat template"
    assert result.first_difference is not None


def test_an_extra_leading_token_is_named_bos(mocks: dict[str, str], tmp_path: Path) -> None:
    result, _ = check(
        mocks["events"], tokenizer_variant(tmp_path, "bos", "<|endoftext|>" + original_template())
    )
    assert result.ok is False
    assert result.cause == "BOS"


def test_a_worker_without_events_is_checked_on_prompt_and_cached_tokens(
    mocks: dict[str, str],
) -> None:
    result, sizes = check(mocks["quiet"], TOKENIZER_DIR)
    assert sizes == {}
    assert result.event_tokens is None
    assert result.engine_prompt_tokens == result.router_tokens
    assert result.ok is True, result


def test_doctor_exits_0_when_all_match_and_1_on_a_template_mismatch(
    mocks: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["doctor", "--worker", mocks["events"], "--tokenizer", str(TOKENIZER_DIR)]) == 0
    report = capsys.readouterr().out
    assert "flavour:      vllm" in report and "block size:   32" in report
    assert "parity:       verified" in report and "vllm:num_requests_running" in report
    other = original_template().replace("message['role'] + '\\n'", "message['role'] + ':\\n'")
    bad = tokenizer_variant(tmp_path, "colon", other)
    assert run(["doctor", "--worker", mocks["events"], "--tokenizer", str(bad)]) == 1
    assert "likely cause: chat template" in capsys.readouterr().out


def test_doctor_rejects_a_bad_worker_url_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["doctor", "--worker", "ftp://x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--worker" in err[0]


def test_the_canary_chain_follows_parent_hashes_from_the_root() -> None:
    events = [
        StoredTokens(1, 0, None, (1, 2), (10, 11, 12, 13), 2),
        StoredTokens(2, 0, 99, (7,), (0, 0), 2),
        StoredTokens(3, 0, 2, (3,), (14, 15), 2),
    ]
    assert event_chain(events) == [10, 11, 12, 13, 14, 15]


def test_likely_cause_tells_bos_template_and_tokenizer_apart() -> None:
    router = [5, 6, 7, 8, 9, 10, 11, 12]
    assert likely_cause(router, [1, *router], router[2:]) == "BOS"
    assert likely_cause(router, [40, 41, *router[2:]], router[2:]) == "chat template"
    assert likely_cause(router, [60, 61, 62, 63, 64], router[2:]) == "tokenizer"


class FakeWorker:
    def __init__(self, url: str) -> None:
        self.id = url
        self.kv_parity: dict | None = None


def test_the_monitor_reports_a_verdict_to_the_gauge_the_worker_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import CollectorRegistry

    from switchyard.router.parity import ParityMonitor

    registry = CollectorRegistry()
    store = KVStore(block_size=16)
    monitor = ParityMonitor(store, object(), registry, interval_s=300)
    worker = FakeWorker("http://w:1")
    bad = ParityResult(worker.id, False, "tokens differ", cause="chat template", block_size=32)
    with caplog.at_level("WARNING", logger="switchyard.router.parity"):
        monitor.report(worker, bad)
        monitor.report(worker, bad)
    gauge = registry.get_sample_value("switchyard_router_kv_parity", {"worker": worker.id})
    assert gauge == 0.0
    assert worker.kv_parity is not None and worker.kv_parity["cause"] == "chat template"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "likely cause: chat template" in lines[0]
    monitor.report(worker, ParityResult(worker.id, True, "verified", block_size=32))
    assert registry.get_sample_value("switchyard_router_kv_parity", {"worker": worker.id}) == 1.0


async def test_one_of_a_routers_processes_sends_the_canaries_and_shares_each_result(
    tmp_path: Path,
) -> None:
    class Worker:
        id = "http://engine:8000"
        kv_parity: dict | None = None

    class Fleet:
        worker = Worker()

        def get(self, worker_id: str) -> Worker | None:
            return self.worker if worker_id == self.worker.id else None

    buses = [SiblingBus(tmp_path, rescan_s=0.05) for _ in range(2)]
    fleets = [Fleet(), Fleet()]
    monitors = [
        ParityMonitor(KVStore(block_size=16), f, CollectorRegistry(), interval_s=300, siblings=b)
        for f, b in zip(fleets, buses, strict=True)
    ]
    for bus in buses:
        await bus.start()
    monitors[1].siblings.on(PARITY, monitors[1]._on_sibling_result)  # as start() does
    try:
        assert [m._checks_here() for m in monitors] == [True, False]
        await asyncio.sleep(0.3)  # the buses find each other and subscribe
        result = ParityResult(Worker.id, True, "verified", block_size=16)
        buses[0].publish(PARITY, orjson.dumps(result.as_dict()))
        for _ in range(100):
            if fleets[1].worker.kv_parity is not None:
                break
            await asyncio.sleep(0.02)
        assert fleets[1].worker.kv_parity is not None and fleets[1].worker.kv_parity["ok"]
        await monitors[0].stop()  # the lock goes with the process that held it
        assert monitors[1]._checks_here()
    finally:
        await monitors[1].stop()
        for bus in buses:
            await bus.stop()
