"""One version everywhere: ``switchyard --version``, the router's start-up line, its
``/health`` and ``switchyard.__version__`` all report the installed package's metadata."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

import switchyard
from switchyard.cli.main import run
from switchyard.router.server import startup_summary
from switchyard.router.settings import RouterSettings
from tests.router.inprocess import running_router

pytestmark = pytest.mark.timeout(60)

INSTALLED = version("switchyard")


def test_version_prints_the_installed_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["--version"]) == 0
    out = capsys.readouterr()
    assert out.out == f"switchyard {INSTALLED}\n" and out.err == ""


def test_version_from_a_real_process() -> None:
    cmd = [sys.executable, "-m", "switchyard", "--version"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"switchyard {INSTALLED}\n", "")


def test_a_bad_flag_beside_it_is_still_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bogus" in err


def test_the_package_attribute_is_the_same_number() -> None:
    assert switchyard.__version__ == INSTALLED


def test_the_router_start_up_line_names_the_version() -> None:
    settings = RouterSettings.load(None, host="127.0.0.1", port=8123, processes=1)
    first = startup_summary(settings)[0]
    assert first == f"switchyard router {INSTALLED}: listening on http://127.0.0.1:8123"


async def test_the_router_health_names_the_version() -> None:
    async with running_router("http://127.0.0.1:9") as router:
        health = await router.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "version": INSTALLED}
