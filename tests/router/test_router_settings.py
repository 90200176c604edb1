"""Settings layer: flags over SWITCHYARD_ROUTER_* environment over YAML over defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from switchyard.balancer.settings import BalancerSettings
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.router.settings import RouterSettings, usable_cores


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "switchyard.yaml"
    path.write_text("router:\n  port: 9001\n  policy: least_load\n  max_attempts: 5\n")
    return path


def test_yaml_section_overrides_defaults(config: Path) -> None:
    settings = RouterSettings.load(config)
    assert (settings.port, settings.policy, settings.max_attempts) == (9001, "least_load", 5)


def test_environment_overrides_yaml(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_PORT", "9002")
    assert RouterSettings.load(config).port == 9002


def test_flags_override_environment(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_PORT", "9002")
    assert RouterSettings.load(config, port=9003).port == 9003


def test_unset_flags_do_not_override(config: Path) -> None:
    settings = RouterSettings.load(config, port=None, workers=[])
    assert settings.port == 9001 and settings.workers == []


def test_defaults_without_any_source() -> None:
    settings = RouterSettings.load()
    assert settings.host == "127.0.0.1" and settings.policy == "kv_aware"


def test_an_old_yaml_key_still_sets_the_renamed_setting(tmp_path: Path) -> None:
    config = tmp_path / "old.yaml"
    config.write_text(
        "router:\n  redis: redis://127.0.0.1:6379/1\n"
        "balancer:\n  probe_interval: 0.5\n  slow_start_seconds: 3\n"
        "kvstore:\n  redis: redis://127.0.0.1:6379/2\n"
    )
    assert RouterSettings.load(config).redis_url == "redis://127.0.0.1:6379/1"
    balancer = BalancerSettings.load(config)
    assert (balancer.probe_interval_s, balancer.slow_start_s) == (0.5, 3.0)
    assert KVStoreSettings.load(config).redis_url == "redis://127.0.0.1:6379/2"


def test_an_old_environment_variable_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_REDIS", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("SWITCHYARD_BALANCER_SCRAPE_INTERVAL", "0.25")
    assert RouterSettings.load().redis_url == "redis://127.0.0.1:6379/3"
    assert BalancerSettings.load().scrape_interval_s == 0.25


def test_an_unprefixed_variable_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS", "redis://elsewhere:6379/0")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    assert RouterSettings.load().redis_url is None


def test_the_new_name_in_the_environment_beats_the_old_name_in_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "old.yaml"
    config.write_text("balancer:\n  probe_interval: 0.5\n")
    monkeypatch.setenv("SWITCHYARD_BALANCER_PROBE_INTERVAL_S", "0.1")
    assert BalancerSettings.load(config).probe_interval_s == 0.1


def test_settings_survive_the_json_handed_to_router_processes() -> None:
    settings = RouterSettings.load(redis_url="redis://127.0.0.1:6379/0")
    again = RouterSettings.model_validate_json(settings.model_dump_json())
    assert again.redis_url == "redis://127.0.0.1:6379/0"


def test_the_default_is_one_process_per_usable_core() -> None:
    settings = RouterSettings()
    assert settings.processes == "auto"
    assert settings.process_count == usable_cores()


def test_auto_is_one_process_when_engines_connect_to_one_listening_socket() -> None:
    settings = RouterSettings(processes="auto", kv_listen="tcp://127.0.0.1:5557")
    assert settings.process_count == 1


@pytest.mark.parametrize(("cpu_max", "cap"), [("200000 100000", 2), ("50000 100000", 1)])
def test_usable_cores_are_capped_by_the_cgroup_quota(
    tmp_path: Path, cpu_max: str, cap: int
) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max + "\n")
    assert usable_cores(path) == min(cap, len(os.sched_getaffinity(0)))


def test_an_unlimited_cgroup_leaves_every_core_usable(tmp_path: Path) -> None:
    path = tmp_path / "cpu.max"
    path.write_text("max 100000\n")
    assert usable_cores(path) == len(os.sched_getaffinity(0))


def test_memory_index_and_kvstore_settings_share_one_capacity_default() -> None:
    assert MemoryIndex().capacity_blocks == KVStoreSettings().capacity_blocks


def test_an_old_name_is_read_with_a_warning_that_names_the_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "old.yaml"
    config.write_text("balancer:\n  lease_seconds: 4\n")
    with caplog.at_level("WARNING", logger="switchyard.core.settings"):
        assert BalancerSettings.load(config).lease_s == 4.0
    assert "lease_seconds is now called lease_s" in caplog.text
