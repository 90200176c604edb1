"""The ``switchyard`` command line: flags generated from the settings, errors as one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

import switchyard.balancer.cli
import switchyard.mock.cli
import switchyard.router.cli
from switchyard.balancer.settings import BalancerSettings
from switchyard.cli.main import cli, run
from switchyard.core.settings import group_of, on_command_line
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.mock.settings import MockSettings
from switchyard.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)

WORKER = ["--worker", "http://127.0.0.1:9"]


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run an invocation that must fail; return its one stderr line."""
    assert run(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    return err.strip()


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What the service commands were given, instead of starting them."""
    seen: list[object] = []
    monkeypatch.setattr(switchyard.router.cli, "_run", lambda s, config: seen.append(s))
    monkeypatch.setattr(switchyard.balancer.cli, "_run", lambda s, config: seen.append(s))
    monkeypatch.setattr(switchyard.mock.cli, "_run", lambda s, config: seen.append(s))
    return seen


def test_missing_tokenizer_names_the_path(capsys: pytest.CaptureFixture[str]) -> None:
    line = bad(capsys, "router", "--tokenizer", "/no/such/tokenizer", *WORKER)
    assert "/no/such/tokenizer" in line and "no such directory" in line


def test_relative_tokenizer_path_says_what_it_is_relative_to(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "deploy" / "local-stack.yaml"
    line = bad(capsys, "router", "--config", str(config))
    assert "src/switchyard/mock/assets/tokenizer" in line and str(tmp_path) in line


def test_unknown_policy_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    line = bad(capsys, "router", "--policy", "bogus", *WORKER)
    assert "'bogus'" in line and "least_load" in line and "kv_aware" in line


def test_unknown_scorer_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    options = '{"scorers": {"vibes": 1}}'
    line = bad(capsys, "router", "--policy", "custom", "--policy-options", options, *WORKER)
    assert "'vibes'" in line and "prefix_cache" in line


def test_bad_policy_options_json_in_the_environment_gives_the_position(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_POLICY_OPTIONS", "{prefill_weight: 1}")
    line = bad(capsys, "router", *WORKER)
    assert "SWITCHYARD_ROUTER_POLICY_OPTIONS" in line and "line 1 column 2" in line


def test_bad_policy_options_json_flag_gives_the_position(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = bad(capsys, "router", "--policy-options", '{"a": }', *WORKER)
    assert "--policy-options" in line and "column 7" in line


def test_invalid_setting_from_the_environment_names_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_PROCESSES", "0")
    line = bad(capsys, "router", *WORKER)
    assert "processes" in line and "at least 1, or auto" in line


def test_processes_that_are_neither_a_count_nor_auto_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = bad(capsys, "router", *WORKER, "--processes", "many")
    assert "processes" in line


def test_several_processes_with_one_listening_socket_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = bad(capsys, "router", *WORKER, "--processes", "2", "--kv-listen", "tcp://127.0.0.1:5557")
    assert "--kv-listen binds one socket" in line


def test_invalid_setting_in_yaml_names_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("balancer:\n  probe_interval_s: soon\n")
    line = bad(capsys, "balancer", "--config", str(config))
    assert "probe_interval_s" in line and "'soon'" in line


def test_unknown_plugin_param_names_the_field_and_the_allowed_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_ROUTER_POLICY_OPTIONS", '{"prefil_weight": 1}')
    line = bad(capsys, "router", "--policy", "kv_aware", *WORKER)
    assert "'prefil_weight'" in line and "allowed:" in line and "prefill_weight" in line


def test_custom_policy_without_options_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = bad(capsys, "router", "--policy", "custom", *WORKER)
    assert "scorers" in line and "least_load" in line


def test_unknown_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--bogus" in bad(capsys, "router", "--bogus")


def test_bad_flag_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--port" in bad(capsys, "mock", "--port", "abc")


def test_a_bad_key_list_is_refused_without_echoing_its_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = bad(capsys, "router", *WORKER, "--api-key", "good-key,:sekrit")
    assert "api_key" in err
    assert "sekrit" not in err and "good-key" not in err


def test_bad_kv_events_spec_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--kv-events" in bad(capsys, "router", *WORKER, "--kv-events", "nonsense")


def test_missing_config_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "/no/such.yaml" in bad(capsys, "router", "--config", "/no/such.yaml")


def test_a_tool_command_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--bogus" in bad(capsys, "bench", "compare", "--bogus")


def test_the_documented_typo_exits_2_with_one_line_from_a_real_process() -> None:
    env = {**os.environ, "SWITCHYARD_ROUTER_POLICY_OPTIONS": '{"prefil_weight": 1}'}
    cmd = [sys.executable, "-m", "switchyard", "router", "--policy", "kv_aware", *WORKER]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "prefil_weight" in done.stderr


@pytest.mark.parametrize("command", ["router", "mock", "balancer", "kvstore", "bench", "demo"])
def test_help_at_80_columns_shows_every_option_name_whole(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    argv = [command, "compare", "--help"] if command == "bench" else [command, "--help"]
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    group = cli()
    cmd = group.commands[command]
    if isinstance(cmd, click.Command) and command in ("router", "mock", "balancer", "kvstore"):
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                for name in param.opts:
                    assert name in out, name


@pytest.mark.parametrize(
    ("command", "model"),
    [
        ("router", RouterSettings),
        ("mock", MockSettings),
        ("balancer", BalancerSettings),
        ("kvstore", KVStoreSettings),
    ],
)
def test_every_setting_has_a_flag(command: str, model: type) -> None:
    """Unless it is marked NO_FLAG: then YAML and the environment set it."""
    cmd = cli().commands[command]
    dests = {p.name for p in cmd.params}
    for name, field in model.model_fields.items():
        group = group_of(field.annotation)
        fields = group.model_fields if group is not None else {"": field}
        for sub, info in fields.items():
            dest = f"{name}__{sub}" if sub else name
            assert (dest in dests) == on_command_line(info), dest


def test_documented_router_flags_reach_the_settings(loaded: list[object]) -> None:
    argv = [
        "router",
        "-w",
        "http://127.0.0.1:9001",
        "--worker",
        "http://127.0.0.1:9002",
        "--kv-events",
        "http://127.0.0.1:9001=tcp://127.0.0.1:5557",
        "--prefill",
        "http://127.0.0.1:9003",
        "--decode",
        "http://127.0.0.1:9004",
        "--pd-protocol",
        "sglang",
        "--pd-min-prefill-tokens",
        "64",
        "--redis",
        "redis://127.0.0.1:6379/0",
        "--policy-options",
        '{"prefill_weight": 2}',
        "--processes",
        "2",
        "--admission-slo-ttft-ms",
        "300",
    ]
    assert run(argv) == 0
    (s,) = loaded
    assert isinstance(s, RouterSettings)
    assert s.workers == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert s.kv.events == ["http://127.0.0.1:9001=tcp://127.0.0.1:5557"]
    assert (s.pd.prefill, s.pd.decode) == (["http://127.0.0.1:9003"], ["http://127.0.0.1:9004"])
    assert (s.pd.protocol, s.pd.min_prefill_tokens) == ("sglang", 64)
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert (s.policy_options, s.processes, s.admission.slo_ttft_ms) == (
        {"prefill_weight": 2},
        2,
        300.0,
    )


def test_nested_flags_merge_with_the_yaml_section(loaded: list[object], tmp_path: Path) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("router:\n  pd:\n    decode_policy: round_robin\n")
    assert run(["router", "--config", str(config), "--pd-protocol", "vllm"]) == 0
    (s,) = loaded
    assert isinstance(s, RouterSettings)
    assert (s.pd.protocol, s.pd.decode_policy) == ("vllm", "round_robin")


def test_an_old_flag_name_still_works(loaded: list[object]) -> None:
    assert run(["balancer", "--probe-interval", "0.5", "--lease-seconds", "4"]) == 0
    (s,) = loaded
    assert isinstance(s, BalancerSettings)
    assert (s.probe_interval_s, s.lease_s) == (0.5, 4.0)


def test_boolean_settings_get_on_and_off_flags(loaded: list[object]) -> None:
    assert run(["mock", "--dp-external", "--no-enable-prefix-caching"]) == 0
    (s,) = loaded
    assert isinstance(s, MockSettings)
    assert (s.dp_external, s.enable_prefix_caching) == (True, False)


def test_repeated_list_flags_collect(loaded: list[object]) -> None:
    assert run(["mock", "--fault-error-codes", "503", "--fault-error-codes", "429"]) == 0
    (s,) = loaded
    assert isinstance(s, MockSettings) and s.fault_error_codes == [503, 429]


def test_router_with_kubernetes_discovery_and_no_client_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import switchyard.router.server as server

    started: list[object] = []
    monkeypatch.setattr(server, "run", lambda *args: started.append(args))
    monkeypatch.setattr(server, "missing_client", lambda: "needs pip install 'switchyard[k8s]'")
    config = tmp_path / "s.yaml"
    config.write_text("balancer:\n  kubernetes: true\n")
    line = bad(capsys, "router", "--config", str(config), *WORKER)
    assert "switchyard[k8s]" in line and not started
