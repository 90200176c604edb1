"""``switchyard simulate --json`` and ``switchyard plan --json`` run on a plain install: the
report libraries of the ``demo`` extra are needed for the tables and plots only.

Each command runs in a fresh interpreter where every library of the extra is unimportable
(``sys.modules[name] = None`` makes ``import name`` raise), as on an install without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def demo_extra() -> list[str]:
    """The import names of the ``demo`` extra's libraries, as pyproject.toml lists them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["optional-dependencies"]["demo"]
    names = [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0] for req in requirements]
    return [name.replace("-", "_") for name in names]


def without_demo(*args: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {demo_extra()!r}: sys.modules[name] = None\n"
        "from switchyard.cli.main import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=110
    )


def only_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The run's stdout, which must be one JSON line and nothing else."""
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1, proc.stdout[-2000:]
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


def test_the_extra_is_what_the_reports_use() -> None:
    assert set(demo_extra()) == {"rich", "matplotlib"}


def test_simulate_json_runs_without_the_demo_extra() -> None:
    proc = without_demo(
        "simulate", "--engines", "100", "--workload", "multiturn", "--json",
        "--rate", "5", "--duration", "2", "--policy", "kv_aware,round_robin",
    )  # fmt: skip
    headline = only_json(proc)
    assert headline["engines"] == 100 and headline["workload"] == "multiturn"
    assert headline["requests"] > 0
    assert set(headline["policies"]) == {"kv_aware", "round_robin"}


def test_plan_json_runs_without_the_demo_extra() -> None:
    proc = without_demo(
        "plan", "--rate", "2", "--duration", "2", "--max-engines", "4",
        "--compare", "kv_aware,round_robin", "--json",
    )  # fmt: skip
    answer = only_json(proc)
    assert answer["policy"] == "kv_aware" and answer["max_engines"] == 4
    assert answer["objective"] == {"ttft_p90_ms": 500.0, "tpot_p90_ms": 50.0}
    met = [p["engines"] for p in answer["probes"] if p["met"]]
    assert answer["engines"] == min(met)
    assert [c["policy"] for c in answer["compared"]] == ["kv_aware", "round_robin"]
    assert "engines:" in proc.stderr  # the probes are still told, on stderr
    assert answer["assumed"].startswith("timing model")


def test_plan_of_a_split_json_runs_without_the_demo_extra() -> None:
    proc = without_demo("plan", "--rate", "2", "--duration", "2", "--pd-engines", "3", "--json")
    answer = only_json(proc)
    assert [(s["prefill"], s["decode"]) for s in answer["splits"]] == [(1, 2), (2, 1)]
    best = answer["best"]
    assert best is not None and best["prefill"] + best["decode"] == 3


@pytest.mark.parametrize(
    ("args", "missing"),
    [
        (("simulate", "--engines", "2"), "rich"),
        (("plan", "--rate", "2"), "rich"),
        (("simulate", "--engines", "2", "--json", "--out", "plots"), "matplotlib"),
    ],
)
def test_tables_and_plots_still_ask_for_the_extra_in_one_line(
    args: tuple[str, ...], missing: str
) -> None:
    proc = without_demo(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert f"needs {missing}" in proc.stderr and "switchyard[demo]" in proc.stderr
