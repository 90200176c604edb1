"""What ``switchyard demo`` compares, with and without smg on the machine."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from switchyard.loadtest import demo
from switchyard.loadtest.compare import run_order
from switchyard.loadtest.routers import RouterSpec


def test_demo_compares_round_robin_with_our_best_policy_without_smg(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo.shutil, "which", lambda _: None)
    cfg = demo.demo_config(6, 2, Path("x"))
    assert cfg.policies == ["round_robin", "kv_aware|cache_aware|least_load"]
    assert cfg.workload == "multiturn" and 4 <= cfg.engines <= 8


def test_demo_adds_smg_cache_aware_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.shutil, "which", lambda _: "/usr/bin/smg")
    assert demo.demo_config(6, 2, Path("x")).policies[-1] == "smg:cache_aware"


def test_repetitions_alternate_the_order_of_configs() -> None:
    assert run_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert run_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert run_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_router_specs_name_ours_or_smg() -> None:
    assert RouterSpec.parse("kv_aware") == RouterSpec("kv_aware", "switchyard", "kv_aware")
    assert RouterSpec.parse("smg:cache_aware") == RouterSpec(
        "smg:cache_aware", "smg", "cache_aware"
    )
    with pytest.raises(ValueError, match="unknown router kind"):
        RouterSpec.parse("nginx:round_robin")


def test_vllm_router_kv_aware_reads_each_engines_events_and_replay_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dataclass
    class Engine:
        url: str
        kv_events: str | None
        kv_replay: str | None

    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("SWITCHYARD_ROUTER_BLOCK_SIZE", "32")
    spec = RouterSpec.parse("vllm-router:kv_aware")
    assert (spec.kind, spec.policy, spec.ready_path) == ("vllm-router", "kv_aware", "/health")
    engines = [Engine("http://e1", "tcp://e1:1", "tcp://e1:2"), Engine("http://e2", None, None)]
    command = spec.command(engines, 8000, "tok", "served")  # type: ignore[arg-type]
    assert command[0] == "/usr/bin/vllm-router"
    pairs = list(zip(command, command[1:], strict=False))
    assert ("--kv-event-source", "http://e1=tcp://e1:1") in pairs
    assert ("--kv-event-replay-source", "http://e1=tcp://e1:2") in pairs
    assert ("--kv-event-block-size", "32") in pairs
    assert ("--kv-event-model", "served") in pairs
    assert not any(value.startswith("http://e2=") for _, value in pairs)


def test_a_router_spec_may_set_our_process_count() -> None:
    spec = RouterSpec.parse("kv_aware@1")
    assert spec == RouterSpec("kv_aware@1", "switchyard", "kv_aware", 1)
    command = spec.command([], 8000, "tok")
    assert command[command.index("--processes") + 1] == "1"
    with pytest.raises(ValueError, match="positive integer"):
        RouterSpec.parse("kv_aware@two")


def test_a_router_run_from_another_checkout_imports_that_checkout(tmp_path: Path) -> None:
    package = tmp_path / "switchyard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    spec = RouterSpec.parse("kv_aware@1").run_from(tmp_path, "HEAD~1")
    command = spec.command([], 8000, "tok")
    python, *flags = command[: command.index("-m")]
    probe = "import switchyard; print(switchyard.__file__)"
    out = subprocess.run(
        [python, *flags, "-c", probe], env=spec.environ(), capture_output=True, text=True
    )
    assert spec.label == "kv_aware@1 HEAD~1"
    assert out.stdout.strip() == str(package / "__init__.py")
