"""``switchyard mock`` settings: flags over SWITCHYARD_MOCK_* env over the YAML 'mock' section."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from switchyard.mock.serve import describe, engine_config
from switchyard.mock.settings import MockSettings
from tests.support import Server, free_port

pytestmark = pytest.mark.timeout(60)


def test_flag_beats_env_beats_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text("mock:\n  model: from-yaml\n  speed: 3\n  num_gpu_blocks: 100\n")
    monkeypatch.setenv("SWITCHYARD_MOCK_SPEED", "7")
    monkeypatch.setenv("SWITCHYARD_MOCK_NUM_GPU_BLOCKS", "200")
    s = MockSettings.load(config, num_gpu_blocks=300, model=None)
    assert (s.model, s.speed, s.num_gpu_blocks) == ("from-yaml", 7.0, 300)


def test_unset_engine_knobs_keep_the_documented_model_defaults() -> None:
    config = engine_config(MockSettings.load(None, flavor="sglang", block_size=32))
    assert config.block_size == 32
    assert config.step_base_us == 5753.0
    assert config.hash_flavor == "sglang"


def test_description_lists_urls_events_and_bootstrap() -> None:
    s = MockSettings.load(
        None,
        port=9000,
        flavor="sglang",
        role="prefill",
        dp_size=2,
        dp_external=True,
        kv_events_port=5557,
        bootstrap_port=9100,
    )
    d = describe(s)
    assert [u["url"] for u in d["urls"]] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert [e["endpoint"] for e in d["kv_events"]] == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    ]
    assert d["bootstrap"] == {"host": "127.0.0.1", "port": 9100}


def test_mock_process_reads_its_yaml_config(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "mock.yaml"
    config.write_text(f"mock:\n  model: yaml-model\n  port: {port}\n  speed: 50\n")
    with Server(["mock", "--config", str(config)], port) as srv:
        models = httpx.get(srv.url + "/v1/models").json()
    assert models["data"][0]["id"] == "yaml-model"
