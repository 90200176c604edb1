"""Settings layer: flags over SWITCHYARD_ROUTER_* environment over YAML over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.settings import RouterSettings


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
