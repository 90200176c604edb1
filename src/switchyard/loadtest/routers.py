"""Router configurations under comparison: ours by policy name, or a peer such as smg.

A spec is ``policy`` (``switchyard router --policy policy``), ``policy@N`` (the same with
``--processes N``), ``smg:policy`` or ``vllm-router:policy`` (those routers, only when
their command is installed). A config that cannot start,
for example a policy this router does not know yet, is reported as unavailable with
the reason it gave, instead of ending the whole comparison.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from switchyard.loadtest.fleet import Engine
from switchyard.loadtest.procs import (
    ProcessExited,
    free_port_block,
    kill_tree,
    python_from,
    wait_http,
)
from switchyard.mock.settings import DEFAULT_TOKENIZER

# Peer routers, by the command that runs them (only where it is installed).
PEERS = ("smg", "vllm-router")
# Policies that read prefixes: they get the tokenizer and each engine's KV-event endpoint.
PREFIX_POLICIES = {"kv_aware", "cache_aware", "latency"}


class Unavailable(RuntimeError):
    """This router configuration could not be started; the message says why."""


@dataclass(frozen=True)
class RouterSpec:
    label: str
    kind: str  # "switchyard", "smg" or "vllm-router"
    policy: str
    processes: int | None = None  # ours: --processes (None: its default)
    code: Path | None = None  # ours: run from this checkout instead of the installed one

    def run_from(self, code: Path, name: str) -> RouterSpec:
        """This config of ours run from the checkout ``code``, labelled with ``name``."""
        if self.kind != "switchyard":
            raise ValueError(f"{self.label} is not a Switchyard router")
        return replace(self, label=f"{self.label} {name}", code=code)

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        kind, sep, policy = text.strip().partition(":")
        if not sep:
            policy, at, count = text.strip().partition("@")
            if not at:
                return cls(text.strip(), "switchyard", policy)
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"{text!r}: the process count after @ must be a positive integer")
            return cls(text.strip(), "switchyard", policy, int(count))
        if kind not in PEERS:
            raise ValueError(
                f"unknown router kind {kind!r} in {text!r} (use POLICY, smg:POLICY or "
                "vllm-router:POLICY)"
            )
        return cls(text.strip(), kind, policy)

    def command(
        self, engines: list[Engine], port: int, tokenizer: str, model: str | None = None
    ) -> list[str]:
        """``model``: the served model's name, which vllm-router's kv_aware needs."""
        if self.kind == "vllm-router":
            return self._vllm_router(engines, port, model)
        if self.kind == "smg":
            exe = shutil.which("smg")
            if exe is None:
                raise Unavailable("smg is not installed")
            return [
                exe, "launch", "--worker-urls", *[e.url for e in engines],
                "--policy", self.policy, "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port_block(1)), "--log-level", "error",
            ]  # fmt: skip
        python, _ = python_from(self.code)
        args = [*python, "-m", "switchyard", "router", "--host", "127.0.0.1"]
        args += ["--port", str(port), "--policy", self.policy, "--log-level", "warning"]
        if self.processes is not None:
            args += ["--processes", str(self.processes)]
        for e in engines:
            args += ["--worker", e.url]
        if self.policy in PREFIX_POLICIES:
            args += ["--tokenizer", tokenizer]
            for e in engines:
                if e.kv_events:
                    args += ["--kv-events", f"{e.url}={e.kv_events}"]
        return args

    def _vllm_router(self, engines: list[Engine], port: int, model: str | None) -> list[str]:
        """vllm-router; its kv_aware policy reads each engine's KV events (and replay
        socket, where the engine names one) at the engines' block size."""
        exe = shutil.which("vllm-router")
        if exe is None:
            raise Unavailable("vllm-router is not installed")
        args = [
            exe, "--worker-urls", *[e.url for e in engines], "--policy", self.policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port_block(1)), "--log-level", "error",
        ]  # fmt: skip
        if self.policy == "kv_aware":
            for e in engines:
                if e.kv_events:
                    args += ["--kv-event-source", f"{e.url}={e.kv_events}"]
                replay = getattr(e, "kv_replay", None)
                if isinstance(replay, str) and replay:
                    args += ["--kv-event-replay-source", f"{e.url}={replay}"]
            block_size = os.environ.get("SWITCHYARD_ROUTER_BLOCK_SIZE")
            if block_size:
                args += ["--kv-event-block-size", block_size]
            if model:
                args += ["--kv-event-model", model]
        return args

    def environ(self) -> dict[str, str]:
        """The router's environment: ours imports from ``code`` when it is set."""
        _, env = python_from(self.code)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    @property
    def ready_path(self) -> str:
        return {"smg": "/readiness", "vllm-router": "/health"}.get(self.kind, "/ready")


@dataclass
class RunningRouter:
    spec: RouterSpec
    url: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes] = field(repr=False)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to it and its processes after 3 s (smg drains for several
        seconds otherwise)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
        self.log.close()

    def __enter__(self) -> RunningRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(log: IO[bytes], limit: int = 400) -> str:
    log.flush()
    log.seek(0)
    lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-4:])[-limit:] or "no output"


def start_router(
    spec: RouterSpec,
    engines: list[Engine],
    tokenizer: str = DEFAULT_TOKENIZER,
    timeout_s: float = 30.0,
    port: int = 0,
    model: str | None = None,
) -> RunningRouter:
    """Start one router config in front of ``engines`` (on ``port``, or a free one if 0);
    ``Unavailable`` if it cannot run."""
    port = port or free_port_block(1)
    command = spec.command(engines, port, tokenizer, model)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=spec.environ())
    router = RunningRouter(spec, f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_http(router.url + spec.ready_path, timeout_s, proc, router.url + "/health")
    except ProcessExited:
        reason = _tail(log)
        router.stop()
        raise Unavailable(f"exited with {proc.returncode}: {reason}") from None
    except TimeoutError:
        reason = _tail(log)
        router.stop()
        raise Unavailable(f"not ready within {timeout_s:.0f}s: {reason}") from None
    return router
