"""The tool commands (mock-fleet, bench, demo, simulate, plan): plain click, like the services."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import pytest

import switchyard.mock.fleet
from switchyard.cli.main import cli, run

pytestmark = pytest.mark.timeout(60)


def all_commands() -> list[list[str]]:
    """Every command path of the tree, nested ones (``bench run``) included."""
    paths: list[list[str]] = []
    for name, command in cli().commands.items():
        paths.append([name])
        if isinstance(command, click.Group):
            paths += [[name, sub] for sub in command.commands]
    return paths


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run an invocation that must fail; return its one stderr line."""
    assert run(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("path", all_commands(), ids=" ".join)
def test_every_command_has_help(path: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*path, "--help"]) == 0
    assert f"Usage: switchyard {' '.join(path)} " in capsys.readouterr().out


def test_no_arguments_shows_the_command_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert run([]) == 0
    out = capsys.readouterr().out
    for name in ("router", "mock-fleet", "bench", "demo", "simulate", "plan"):
        assert f"  {name} " in out


def test_a_group_without_a_subcommand_shows_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["bench"]) == 0
    out = capsys.readouterr().out
    assert "compare" in out and "run" in out


def test_an_error_in_a_nested_command_names_the_whole_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bad(capsys, "bench", "run") == "switchyard bench run: Missing option '--target'."


def test_an_option_without_its_value_names_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = bad(capsys, "simulate", "--engines")
    assert line.startswith("switchyard simulate: ") and "--engines" in line


def test_a_bad_workload_parameter_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = bad(capsys, "bench", "compare", "--param", "speedup")
    assert "'speedup': expected KEY=VALUE" in line


def test_plan_refuses_a_trace_workload(capsys: pytest.CaptureFixture[str]) -> None:
    line = bad(capsys, "plan", "--rate", "1", "--workload", "mooncake")
    assert line == (
        "switchyard plan: Invalid value: plan takes generated workloads (rate and duration)"
    )


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["demo"], "matplotlib"),
        (["bench", "compare"], "rich"),
        (["bench", "run", "--target", "http://127.0.0.1:9"], "matplotlib"),
        (["simulate"], "rich"),
        (["simulate", "--out", "plots"], "matplotlib"),
        (["plan", "--rate", "1"], "rich"),
    ],
)
def test_a_report_command_without_the_demo_extra_says_what_to_install(
    argv: list[str],
    missing: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # find_spec: not installed
    line = bad(capsys, *argv)
    assert missing in line and "pip install 'switchyard[demo]'" in line


def test_mock_fleet_hands_its_flags_to_the_fleet_planner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    planned: list[tuple[Any, ...]] = []
    ran: list[tuple[Any, ...]] = []
    monkeypatch.setattr(switchyard.mock.fleet, "plan_fleet", lambda *a: planned.append(a) or [])
    monkeypatch.setattr(switchyard.mock.fleet, "run_fleet", lambda *a: ran.append(a))
    config = tmp_path / "mock.yaml"
    argv = ["mock-fleet", "--count", "3", "--prefill", "1", "--decode", "2", "--config"]
    argv += [str(config), "--speed", "5", "--dp-external", "--processes", "2"]
    assert run(argv) == 0
    ((got_config, flags, count, base_port, prefill, decode, events_port),) = planned
    assert (got_config, count, base_port, prefill, decode, events_port) == (
        config, 3, 8100, 1, 2, None,
    )  # fmt: skip
    assert flags == {
        "flavor": None,
        "model": None,
        "dp_size": None,
        "dp_external": True,
        "num_gpu_blocks": None,
        "speed": 5.0,
        "seed": None,
        "kv_events_encoding": None,
    }
    assert ran == [([], 2)]


def test_kubernetes_discovery_without_the_k8s_extra_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(a))
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # find_spec: not installed
    line = bad(capsys, "balancer", "--kubernetes")
    assert line == (
        "switchyard balancer: Kubernetes discovery needs the kubernetes client: "
        "pip install 'switchyard[k8s]'"
    )
    assert started == []


def test_the_balancer_without_kubernetes_discovery_needs_no_kubernetes_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvicorn

    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(a))
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    assert run(["balancer"]) == 0
    assert len(started) == 1
