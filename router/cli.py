"""``switchyard router``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("router")
    def router_command(
        worker: Annotated[
            list[str] | None,
            typer.Option(
                "--worker",
                "-w",
                help="Worker URL, repeatable; options as 'http://h:p;role=prefill;dp=4'.",
            ),
        ] = None,
        config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
        policy: Annotated[
            str | None,
            typer.Option(
                help="round_robin, random, least_load, power_of_two, consistent_hash, "
                "cache_aware, kv_aware, custom."
            ),
        ] = None,
        host: Annotated[str | None, typer.Option(help="Bind address.")] = None,
        port: Annotated[int | None, typer.Option(help="Bind port.")] = None,
        api_key: Annotated[str | None, typer.Option(help="Bearer key clients must send.")] = None,
        admin_api_key: Annotated[str | None, typer.Option(help="Bearer key for /admin.")] = None,
        log_level: Annotated[str | None, typer.Option(help="uvicorn log level.")] = None,
        tokenizer: Annotated[
            str | None, typer.Option(help="HF tokenizer dir (tokenizer.json + chat template).")
        ] = None,
        kv_events: Annotated[
            list[str] | None,
            typer.Option(
                "--kv-events", help="WORKER_URL=tcp://HOST:PORT of its KV-event publisher."
            ),
        ] = None,
        kvstore: Annotated[
            str | None, typer.Option(help="'embedded' or the URL of a kvstore service.")
        ] = None,
        balancer: Annotated[
            str | None, typer.Option(help="'embedded' or the URL of a balancer service.")
        ] = None,
        redis: Annotated[
            str | None, typer.Option(help="Redis URL shared by router replicas.")
        ] = None,
        slo_ttft_ms: Annotated[
            float | None, typer.Option(help="Default TTFT objective for admission, ms.")
        ] = None,
        processes: Annotated[
            int | None,
            typer.Option(help="Router processes on the port (more cores; --redis shares state)."),
        ] = None,
        prefill: Annotated[
            list[str] | None,
            typer.Option("--prefill", help="Prefill worker URL (P/D), repeatable; ';bootstrap=N'."),
        ] = None,
        decode: Annotated[
            list[str] | None, typer.Option("--decode", help="Decode worker URL (P/D), repeatable.")
        ] = None,
        encode: Annotated[
            list[str] | None,
            typer.Option("--encode", help="Encode worker URL (E/P/D), repeatable."),
        ] = None,
        pd_protocol: Annotated[
            str | None, typer.Option(help="P/D wire protocol: vllm or sglang.")
        ] = None,
        pd_min_prefill_tokens: Annotated[
            int | None,
            typer.Option(help="Skip the prefill pool below this many uncached prompt tokens."),
        ] = None,
    ) -> None:
        """Run the OpenAI-compatible router in front of a fleet of engines."""
        from router.server import run
        from router.settings import RouterSettings

        settings = RouterSettings.load(
            config,
            workers=worker,
            policy=policy,
            host=host,
            port=port,
            api_key=api_key,
            admin_api_key=admin_api_key,
            log_level=log_level,
            tokenizer=tokenizer,
            kv_events=kv_events,
            kvstore=kvstore,
            balancer=balancer,
            redis=redis,
            slo_ttft_ms=slo_ttft_ms,
            processes=processes,
            pd={
                k: v
                for k, v in {
                    "prefill": prefill,
                    "decode": decode,
                    "encode": encode,
                    "protocol": pd_protocol,
                    "min_prefill_tokens": pd_min_prefill_tokens,
                }.items()
                if v is not None
            }
            or None,
        )
        run(settings, config)
