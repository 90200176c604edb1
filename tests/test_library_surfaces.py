"""The parts of uvicorn and prometheus_client we build on that are not their public API.

``router.server`` subclasses uvicorn's process supervisor and server, ``router.connections``
stands in for uvicorn's HTTP protocol and ``router.metrics`` replaces prometheus_client's
multiprocess value class, writing its files itself. ``pyproject.toml`` pins both libraries
to the versions tested; these tests say what breaks when a new version moves one of them.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, values
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState
from uvicorn.supervisors.multiprocess import Multiprocess

from switchyard.router.connections import ClientConnection
from switchyard.router.metrics import METRICS_DIR_ENV


def parameters(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- uvicorn ---------------------------------------------------------------------------------


def test_the_supervisor_takes_a_config_and_its_sockets() -> None:
    """``ClosingSupervisor.__init__`` calls ``super().__init__(config, sockets)``."""
    assert parameters(Multiprocess.__init__) == ["self", "config", "sockets"]


def test_the_supervisor_has_the_hooks_and_state_we_override() -> None:
    supervisor = Multiprocess(uvicorn.Config(app=lambda: None, workers=2), sockets=[])
    assert isinstance(supervisor.signal_queue, list)
    assert isinstance(supervisor.processes, list)
    assert supervisor.sockets == []
    for hook in ("keep_subprocess_alive", "terminate_all"):
        assert parameters(getattr(Multiprocess, hook)) == ["self"], hook


def test_the_server_loop_and_exit_hooks_we_replace() -> None:
    """``router.mainloop`` swaps ``main_loop`` for its own around ``on_tick``."""
    assert inspect.iscoroutinefunction(uvicorn.Server.main_loop)
    assert parameters(uvicorn.Server.main_loop) == ["self"]
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick)
    assert parameters(uvicorn.Server.on_tick) == ["self", "counter"]
    assert parameters(uvicorn.Server.handle_exit) == ["self", "sig", "frame"]
    server = uvicorn.Server(uvicorn.Config(app=lambda: None))
    assert server.started is False


def test_the_server_installs_its_own_bound_handle_exit_as_signal_handler() -> None:
    """``_drain_on_signals`` finds a process's server as ``signal.getsignal(sig).__self__``."""
    source = inspect.getsource(uvicorn.Server.capture_signals)
    assert "signal.signal(sig, self.handle_exit)" in source


def test_our_connection_is_built_as_uvicorns_http_protocol_is() -> None:
    """``Config(http=partial(ClientConnection, limits=...))``: uvicorn passes these."""
    theirs = parameters(HttpToolsProtocol.__init__)
    assert theirs == ["self", "config", "server_state", "app_state", "_loop"]
    assert parameters(ClientConnection.__init__)[: len(theirs)] == theirs
    state = ServerState()
    assert isinstance(state.connections, set) and isinstance(state.tasks, set)


def test_the_config_options_the_router_sets_exist() -> None:
    options = set(parameters(uvicorn.Config.__init__))
    router_sets = {"loop", "lifespan", "access_log", "proxy_headers", "log_level", "http"}
    router_sets |= {"timeout_graceful_shutdown", "server_header", "date_header"}
    assert router_sets <= options


# -- prometheus_client ----------------------------------------------------------------------


def test_metrics_make_their_values_through_values_value_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Looked up when a metric (or a child) is made, with the arguments
    ``write_metrics_behind``'s value class takes."""
    made: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append((args, kwargs))

        def inc(self, amount: float) -> None: ...

        def set(self, value: float, timestamp: float | None = None) -> None: ...

        def get(self) -> float:
            return 0.0

    monkeypatch.setattr(values, "ValueClass", Recording)
    registry = CollectorRegistry()
    Counter("c", "help c", ["route"], registry=registry).labels("a").inc()
    Gauge("g", "help g", registry=registry, multiprocess_mode="livesum").set(1)
    assert made == [
        (("counter", "c", "c_total", ("route",), ("a",), "help c"), {}),
        (("gauge", "g", "g", (), (), "help g"), {"multiprocess_mode": "livesum"}),
    ]


def test_metric_files_are_what_the_multiprocess_collector_sums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``router.metrics`` writes ``{type}_{pid}.db`` with ``MmapedDict`` and ``mmap_key`` into
    the directory named by ``METRICS_DIR_ENV``, which the collector reads."""
    assert parameters(mmap_key) == ["metric_name", "name", "labelnames", "labelvalues", "help_text"]
    key = mmap_key("c", "c_total", ["route"], ["a"], "help c")
    for pid, amount in ((1, 2.0), (2, 3.0)):
        file = MmapedDict(str(tmp_path / f"counter_{pid}.db"))
        assert file.read_value(key) == (0.0, 0.0)
        file.write_value(key, amount, 0.0)
        file.close()
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    assert registry.get_sample_value("c_total", {"route": "a"}) == 5.0
