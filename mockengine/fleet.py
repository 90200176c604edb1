"""``switchyard mock-fleet``: many mock engines, cheaply, with a JSON map of what runs where.

In one process every engine gets its own uvicorn server on the same event loop (an
idle engine costs almost nothing); ``--processes K`` spreads them over K children so
a load test can use more cores. The printed JSON lists each engine's URLs, DP ranks,
role, KV-event endpoints and (SGLang prefill) bootstrap port.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from mockengine.serve import build, describe, run_blocking
from mockengine.settings import MockSettings
from mockengine.tokenizer import ModelTokenizer


def plan_fleet(
    config: Path | None,
    flags: dict[str, Any],
    count: int,
    base_port: int,
    prefill: int,
    decode: int,
    kv_events_base_port: int | None,
) -> list[MockSettings]:
    """One settings object per engine: ports, roles, event ports and seeds laid out."""
    base = MockSettings.load(config, **flags)
    stride = base.dp_size if base.dp_external else 1
    specs: list[MockSettings] = []
    for i in range(count):
        role = "prefill" if i < prefill else "decode" if i < prefill + decode else base.role
        changes: dict[str, Any] = {
            "port": base_port + i * stride,
            "role": role,
            "seed": base.seed + i,
            "engine_id": f"{base.engine_id or 'mock'}-{i}",
        }
        if kv_events_base_port is not None:
            changes["kv_events_port"] = kv_events_base_port + i * base.dp_size
        if base.flavor == "sglang" and role == "prefill":
            changes["bootstrap_port"] = base_port + count * stride + i
        specs.append(base.model_copy(update=changes))
    return specs


def _serve_in_process(specs: list[MockSettings], on_ready_line: str | None) -> None:
    tokenizers: dict[str, ModelTokenizer] = {}
    deployments = []
    for s in specs:
        tok = tokenizers.get(s.tokenizer) or tokenizers.setdefault(
            s.tokenizer, ModelTokenizer(s.tokenizer)
        )
        deployments.append(build(s, tok))

    def ready() -> None:
        line = on_ready_line or json.dumps({"engines": [d.describe() for d in deployments]})
        print(line, flush=True)

    run_blocking(deployments, ready)


def run_specs(spec_json: str) -> None:
    """Child process of a multi-process fleet: serve the given engines, say when ready."""
    specs = [MockSettings.model_validate(d) for d in json.loads(spec_json)]
    _serve_in_process(specs, json.dumps({"ready": True}))


def describe_fleet(specs: list[MockSettings]) -> dict[str, Any]:
    return {"engines": [describe(s) for s in specs]}


def run_fleet(specs: list[MockSettings], processes: int) -> None:
    if processes <= 1:
        _serve_in_process(specs, None)
        return
    groups = [specs[i::processes] for i in range(processes) if specs[i::processes]]
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "switchyard",
                "mock-fleet",
                "--spec-json",
                json.dumps([s.model_dump() for s in group]),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for group in groups
    ]

    def stop(*_: object) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            stop()
            raise SystemExit(f"fleet child {child.pid} exited before it was ready")
    print(json.dumps(describe_fleet(specs)), flush=True)
    for child in children:
        child.wait()
