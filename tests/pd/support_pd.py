"""Mock P/D fleets and routers in front of them, as real processes on loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from switchyard.loadtest.prom import values
from tests.support import Server, free_port, one_process

MODEL = "mock-model"
LONG_PROMPT = "disaggregated prefill across the fleet " * 20


def mock(*args: str, speed: str = "20") -> Server:
    port = free_port()
    return Server(["mock", "--port", str(port), "--speed", speed, *args], port).start()


def sglang_prefill(*args: str) -> tuple[Server, int]:
    boot = free_port()
    server = mock("--flavor", "sglang", "--role", "prefill", "--bootstrap-port", str(boot), *args)
    return server, boot


def spec(url: str, **options: object) -> str:
    """A worker URL with its model declared, so it routes before the first /v1/models poll."""
    extra = "".join(f";{k}={v}" for k, v in options.items())
    return f"{url};models={MODEL}{extra}"


def router(
    tmp: Path,
    protocol: str,
    *,
    prefill: list[str] = (),  # type: ignore[assignment]
    decode: list[str] = (),  # type: ignore[assignment]
    encode: list[str] = (),  # type: ignore[assignment]
    workers: list[str] = (),  # type: ignore[assignment]
    pd: dict[str, object] | None = None,
    args: tuple[str, ...] = (),
) -> Server:
    port = free_port()
    argv = ["router", "--port", str(port), "--pd-protocol", protocol]
    for flag, urls in (("--prefill", prefill), ("--decode", decode), ("--encode", encode)):
        for url in urls:
            argv += [flag, url]
    for url in workers:
        argv += ["--worker", url]
    if pd:
        path = tmp / f"router-{port}.yaml"
        path.write_text(yaml.safe_dump({"router": {"pd": pd}}))
        argv += ["--config", str(path)]
    return Server([*argv, *one_process(args), *args], port).start()


def vllm_pair(
    tmp: Path,
    *,
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    pd: dict[str, object] | None = None,
    args: tuple[str, ...] = (),
) -> tuple[Server, Server, Server]:
    """One vLLM prefill mock, one decode mock and a router in front: (router, prefill, decode)."""
    prefill = mock("--role", "prefill", *prefill_args)
    decode = mock("--role", "decode", *decode_args)
    front = router(
        tmp, "vllm", prefill=[spec(prefill.url)], decode=[spec(decode.url)], pd=pd, args=args
    )
    return front, prefill, decode


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(values(httpx.get(url + "/metrics").text, name, **labels))
