"""Settings layer: flags over SWITCHYARD_ROUTER_* environment over YAML over defaults, the
router's groups (timeouts, limits, retry, admission, kv, pd) and the old names they replace."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import switchyard.router.cli as router_cli
from switchyard.balancer.settings import BalancerSettings
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.router.settings import KV, RouterSettings, Timeouts, usable_cores


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "switchyard.yaml"
    path.write_text("router:\n  port: 9001\n  policy: least_load\n  retry: {max_attempts: 5}\n")
    return path


def test_yaml_section_overrides_defaults(config: Path) -> None:
    settings = RouterSettings.load(config)
    assert (settings.port, settings.policy, settings.retry.max_attempts) == (9001, "least_load", 5)


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
    settings = RouterSettings(processes="auto", kv=KV(listen="tcp://127.0.0.1:5557"))
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
    assert "YAML key balancer.lease_seconds is deprecated; use balancer.lease_s" in caplog.text


# -- groups ---------------------------------------------------------------------------------


def test_each_group_is_one_value_with_a_readable_repr() -> None:
    timeouts = RouterSettings().timeouts
    assert repr(timeouts).startswith("Timeouts(connect_s=3.0, first_byte_s=600.0")
    assert timeouts == Timeouts()


def test_the_groups_keep_the_defaults_of_the_flat_settings_they_replace() -> None:
    s = RouterSettings()
    assert (s.timeouts.connect_s, s.timeouts.first_byte_s, s.timeouts.idle_s) == (3, 600, 120)
    assert (s.timeouts.header_s, s.timeouts.body_s, s.timeouts.keep_alive_s) == (10, 60, 30)
    assert (s.timeouts.shutdown_s, s.timeouts.drain_s) == (30, 0)
    assert (s.limits.max_header_bytes, s.limits.max_body_bytes) == (32 * 1024, 32 * 1024 * 1024)
    assert (s.limits.max_client_connections, s.limits.max_in_flight_per_tenant) == (2048, 0)
    assert (s.retry.max_attempts, s.retry.backoff_s, s.retry.after_s) == (3, 0.02, 1)
    assert (s.admission.slo_ttft_ms, s.admission.max_wait_ms) == (None, 250)
    assert (s.kv.events, s.kv.block_size, s.kv.parity) == ([], None, True)


def test_a_group_merges_across_yaml_environment_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("router:\n  timeouts: {connect_s: 5, idle_s: 7, header_s: 9}\n")
    monkeypatch.setenv("SWITCHYARD_ROUTER_TIMEOUTS__IDLE_S", "8")
    timeouts = RouterSettings.load(config, timeouts={"header_s": 4}).timeouts
    assert (timeouts.connect_s, timeouts.idle_s, timeouts.header_s) == (5, 8, 4)


def test_grouped_flags_merge_with_the_yaml_group(
    tmp_path: Path, loaded: list[RouterSettings]
) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("router:\n  retry: {backoff_s: 0.1}\n")
    s = invoke(
        loaded, "--config", str(config), "--retry-max-attempts", "5", "--timeouts-connect-s", "2"
    )
    assert (s.retry.max_attempts, s.retry.backoff_s, s.timeouts.connect_s) == (5, 0.1, 2)


def test_a_bad_value_in_a_group_names_the_setting_by_its_path() -> None:
    result = CliRunner().invoke(router_cli.command(), ["--timeouts-connect-s", "0"])
    assert result.exit_code == 2
    assert "invalid setting timeouts.connect_s" in result.output


# -- old names, one release -----------------------------------------------------------------


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[RouterSettings]:
    """The settings ``switchyard router`` would run with, instead of running it."""
    runs: list[RouterSettings] = []
    monkeypatch.setattr(router_cli, "_run", lambda settings, config: runs.append(settings))
    return runs


def invoke(loaded: list[RouterSettings], *argv: str) -> RouterSettings:
    result = CliRunner().invoke(router_cli.command(), list(argv))
    assert result.exit_code == 0, result.output
    return loaded[-1]


def test_an_old_flag_sets_the_moved_setting_with_a_one_line_warning(
    loaded: list[RouterSettings],
) -> None:
    result = CliRunner().invoke(router_cli.command(), ["--connect-timeout-s", "5"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "warning: --connect-timeout-s is deprecated; use --timeouts-connect-s\n"


@pytest.mark.parametrize(
    ("argv", "where", "value"),
    [
        (["--connect-timeout-s", "5"], ("timeouts", "connect_s"), 5.0),
        (["--shutdown-drain-s", "4"], ("timeouts", "drain_s"), 4.0),
        (["--max-body-bytes", "1024"], ("limits", "max_body_bytes"), 1024),
        (["--tenant-max-in-flight", "2"], ("limits", "max_in_flight_per_tenant"), 2),
        (["--max-attempts", "1"], ("retry", "max_attempts"), 1),
        (["--slo-ttft-ms", "300"], ("admission", "slo_ttft_ms"), 300.0),
        (["--block-size", "32"], ("kv", "block_size"), 32),
        (["--parity-interval-s", "0"], ("kv", "parity_interval_s"), 0.0),
        (["--first-byte-base-s", "2"], ("timeouts", "first_byte_base_s"), 2.0),
    ],
)
def test_old_flags_land_on_their_new_place(
    loaded: list[RouterSettings], argv: list[str], where: tuple[str, str], value: object
) -> None:
    group, name = where
    assert getattr(getattr(invoke(loaded, *argv), group), name) == value


def test_the_new_flag_wins_over_the_old_one(loaded: list[RouterSettings]) -> None:
    s = invoke(loaded, "--connect-timeout-s", "5", "--timeouts-connect-s", "2")
    assert s.timeouts.connect_s == 2


def test_old_flags_are_hidden_from_help() -> None:
    text = CliRunner().invoke(router_cli.command(), ["--help"], terminal_width=200).output
    assert "--timeouts-connect-s" in text and "--connect-timeout-s" not in text
    assert "--retry-max-attempts" in text and "--max-attempts " not in text


def test_a_setting_without_a_flag_is_named_by_its_yaml_key_and_variable(
    loaded: list[RouterSettings],
) -> None:
    result = CliRunner().invoke(router_cli.command(), ["--first-byte-base-s", "2"])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: --first-byte-base-s is deprecated; use router.timeouts.first_byte_base_s "
        "in the YAML file or SWITCHYARD_ROUTER_TIMEOUTS__FIRST_BYTE_BASE_S\n"
    )


def test_help_lists_the_options_under_their_group_headings() -> None:
    text = CliRunner().invoke(router_cli.command(), ["--help"], terminal_width=200).output
    headings = [
        line[:-1] for line in text.splitlines() if line and line[0] != " " and line[-1] == ":"
    ]
    assert headings == [
        "Service",
        "Fleet and routing",
        "Auth",
        "Timeouts",
        "Limits",
        "Retry",
        "Migration",
        "TLS to workers",
        "Admission",
        "KV-aware routing",
        "Flow control",
        "Tracing",
        "P/D",
        "Other",
    ]
    timeouts = text.split("Timeouts:")[1].split("Limits:")[0]
    assert "--timeouts-idle-s" in timeouts and "--timeouts-first-byte-base-s" not in timeouts


def test_an_old_flat_yaml_key_moves_into_its_group_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "old.yaml"
    config.write_text(
        "router:\n  connect_timeout_s: 5\n  max_attempts: 4\n  kv_events: ['http://a=tcp://h:1']\n"
    )
    with caplog.at_level(logging.WARNING, logger="switchyard.core.settings"):
        s = RouterSettings.load(config)
    assert (s.timeouts.connect_s, s.retry.max_attempts, s.kv.events) == (
        5,
        4,
        ["http://a=tcp://h:1"],
    )
    assert caplog.messages == [
        "YAML key router.connect_timeout_s is deprecated; use router.timeouts.connect_s",
        "YAML key router.max_attempts is deprecated; use router.retry.max_attempts",
        "YAML key router.kv_events is deprecated; use router.kv.events",
    ]


def test_the_new_yaml_key_wins_over_the_old_one_in_the_same_file(tmp_path: Path) -> None:
    config = tmp_path / "both.yaml"
    config.write_text("router:\n  idle_timeout_s: 5\n  timeouts: {idle_s: 7}\n")
    assert RouterSettings.load(config).timeouts.idle_s == 7


def test_an_old_environment_variable_moves_into_its_group_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_SHUTDOWN_TIMEOUT_S", "12")
    monkeypatch.setenv("SWITCHYARD_ROUTER_KV_EVENTS", '["http://a=tcp://h:1"]')
    with caplog.at_level(logging.WARNING, logger="switchyard.core.settings"):
        s = RouterSettings.load()
    assert (s.timeouts.shutdown_s, s.kv.events) == (12, ["http://a=tcp://h:1"])
    assert sorted(caplog.messages) == [
        "SWITCHYARD_ROUTER_KV_EVENTS is deprecated; use SWITCHYARD_ROUTER_KV__EVENTS",
        "SWITCHYARD_ROUTER_SHUTDOWN_TIMEOUT_S is deprecated; "
        "use SWITCHYARD_ROUTER_TIMEOUTS__SHUTDOWN_S",
    ]


def test_an_old_variable_beats_the_yaml_and_loses_to_the_new_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("router:\n  timeouts: {body_s: 5}\n")
    monkeypatch.setenv("SWITCHYARD_ROUTER_BODY_TIMEOUT_S", "6")
    assert RouterSettings.load(config).timeouts.body_s == 6
    monkeypatch.setenv("SWITCHYARD_ROUTER_TIMEOUTS__BODY_S", "7")
    assert RouterSettings.load(config).timeouts.body_s == 7


def test_an_old_list_variable_that_is_not_json_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, loaded: list[RouterSettings]
) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_KV_EVENTS", "http://a=tcp://h:1")
    result = CliRunner().invoke(router_cli.command(), [])
    assert result.exit_code == 2
    assert "SWITCHYARD_ROUTER_KV_EVENTS is not valid JSON" in result.output


def test_the_embedded_balancer_reads_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard.router.server import build_fleet

    monkeypatch.setenv("SWITCHYARD_BALANCER_PROBE_INTERVAL_S", "0.75")
    fleet = build_fleet(RouterSettings(), None)
    assert fleet.settings.probe_interval_s == 0.75  # type: ignore[attr-defined]
