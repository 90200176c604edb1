"""What importing a part of the package starts: package faces, settings and the command line
stay light, and a plain install (no extras) runs the router.

Each case imports in a fresh interpreter, so what this test process imported does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGES = ["core", "net", "balancer", "kvstore", "mock", "router", "loadtest", "cli"]
SETTINGS = ["balancer.settings", "kvstore.settings", "mock.settings", "router.settings"]
CLIENTS = ["aiohttp", "httpx", "redis", "tiktoken", "jinja2", "tokenizers", "uvicorn", "zmq"]
EXTRAS = ["matplotlib", "rich", "kubernetes", "typer"]


def loaded_after(*modules: str, blocked: tuple[str, ...] = ()) -> set[str]:
    """Top-level names in ``sys.modules`` after importing ``modules`` in a new interpreter,
    where the ``blocked`` libraries are not installed (importing one raises ImportError)."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(blocked)!r}: sys.modules[name] = None\n"
        f"for name in {list(modules)!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout))


def test_package_faces_import_nothing_heavy() -> None:
    loaded = loaded_after("switchyard", *(f"switchyard.{p}" for p in PACKAGES))
    assert loaded & {*CLIENTS, *EXTRAS, "fastapi", "pydantic"} == set()


@pytest.mark.parametrize("module", SETTINGS)
def test_settings_import_no_client_or_tokenizer(module: str) -> None:
    assert loaded_after(f"switchyard.{module}") & {*CLIENTS, *EXTRAS} == set()


def test_the_command_line_needs_no_extra_until_a_report_command_runs() -> None:
    loaded_after("switchyard.cli.main", blocked=tuple(EXTRAS))


def test_the_router_needs_no_extra() -> None:
    loaded_after("switchyard.router.server", "switchyard.router.app", blocked=tuple(EXTRAS))


def test_the_blocking_itself_is_seen() -> None:
    """The two tests above would pass vacuously if a blocked import went unnoticed."""
    with pytest.raises(AssertionError, match="ModuleNotFoundError|ImportError"):
        loaded_after("rich.console", blocked=("rich",))
