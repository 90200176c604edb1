"""``switchyard mock`` (one engine, possibly several DP ranks) and ``switchyard mock-fleet``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("mock")
    def mock_command(
        config: Annotated[Path | None, Opt(help="YAML config file (section 'mock').")] = None,
        host: Annotated[str | None, Opt(help="Bind address.")] = None,
        port: Annotated[
            int | None, Opt(help="HTTP port (rank r on port+r with --dp-external).")
        ] = None,
        flavor: Annotated[
            str | None, Opt(help="vllm or sglang: API extras, metrics, hashing.")
        ] = None,
        model: Annotated[str | None, Opt(help="Served model name.")] = None,
        tokenizer: Annotated[str | None, Opt(help="HF tokenizer dir with chat_template.")] = None,
        max_model_len: Annotated[int | None, Opt(help="Context length.")] = None,
        default_max_tokens: Annotated[int | None, Opt(help="max_tokens when omitted.")] = None,
        role: Annotated[str | None, Opt(help="unified, prefill, decode or encode.")] = None,
        engine_id: Annotated[str | None, Opt(help="remote_engine_id for P/D.")] = None,
        block_size: Annotated[int | None, Opt(help="Tokens per KV block.")] = None,
        num_gpu_blocks: Annotated[int | None, Opt(help="KV blocks per rank.")] = None,
        max_num_seqs: Annotated[int | None, Opt(help="Max running requests per rank.")] = None,
        max_num_batched_tokens: Annotated[int | None, Opt(help="Per-step token budget.")] = None,
        enable_prefix_caching: Annotated[bool | None, Opt(help="Prefix caching.")] = None,
        step_base_us: Annotated[float | None, Opt(help="Per-step fixed cost, µs.")] = None,
        prefill_token_us: Annotated[
            float | None, Opt(help="Per uncached prefill token, µs.")
        ] = None,
        decode_token_us: Annotated[float | None, Opt(help="Per decode sequence, µs.")] = None,
        context_token_us: Annotated[
            float | None, Opt(help="Per attended context token, µs.")
        ] = None,
        kv_transfer_us_per_block: Annotated[float | None, Opt(help="P/D pull, µs/block.")] = None,
        held_kv_timeout_s: Annotated[float | None, Opt(help="Prefill hold expiry, s.")] = None,
        speed: Annotated[float | None, Opt(help="Time compression factor.")] = None,
        seed: Annotated[int | None, Opt(help="Random seed.")] = None,
        dp_size: Annotated[int | None, Opt(help="Data-parallel ranks.")] = None,
        dp_external: Annotated[bool | None, Opt(help="One port per DP rank.")] = None,
        kv_events_port: Annotated[int | None, Opt(help="ZMQ PUB port (+rank).")] = None,
        kv_events_replay_port: Annotated[int | None, Opt(help="ZMQ replay port (+rank).")] = None,
        kv_events_encoding: Annotated[str | None, Opt(help="array (older vLLM) or map.")] = None,
        kv_events_topic: Annotated[str | None, Opt(help="ZMQ topic.")] = None,
        bootstrap_port: Annotated[int | None, Opt(help="SGLang prefill bootstrap port.")] = None,
        pd_wait_timeout_s: Annotated[
            float | None, Opt(help="Decode wait for prefill KV, s.")
        ] = None,
        encode_us_per_image: Annotated[
            float | None, Opt(help="Encoder time per image, µs.")
        ] = None,
        fault_error_rate: Annotated[
            float | None, Opt(help="Fraction answered with an error.")
        ] = None,
        fault_error_codes: Annotated[list[int] | None, Opt(help="Error statuses (repeat).")] = None,
        fault_latency_rate: Annotated[float | None, Opt(help="Fraction delayed.")] = None,
        fault_latency_ms: Annotated[float | None, Opt(help="Delay of a latency spike.")] = None,
        fault_hang_rate: Annotated[float | None, Opt(help="Fraction never answered.")] = None,
        fault_crash_after: Annotated[int | None, Opt(help="Exit when request N+1 arrives.")] = None,
        fault_slow_stream_ms: Annotated[float | None, Opt(help="Extra delay per chunk.")] = None,
        fault_drop_after_tokens: Annotated[int | None, Opt(help="Cut streams after N.")] = None,
        fault_drop_rate: Annotated[float | None, Opt(help="Fraction of streams cut.")] = None,
        fault_kv_gap: Annotated[int | None, Opt(help="Skip N KV-event seqs at start.")] = None,
    ) -> None:
        """Run one simulated vLLM/SGLang engine (DP ranks, P/D role, faults) on loopback."""
        import orjson

        from mockengine.serve import build, run_blocking
        from mockengine.settings import MockSettings

        flags = {k: v for k, v in locals().items() if k not in ("config", "app")}
        settings = MockSettings.load(config, **flags)
        deployment = build(settings)
        run_blocking([deployment], lambda: typer.echo(orjson.dumps(deployment.describe()).decode()))

    @app.command("mock-fleet")
    def mock_fleet_command(
        count: Annotated[int, Opt(help="Number of engines.")] = 2,
        base_port: Annotated[int, Opt(help="First HTTP port.")] = 8100,
        processes: Annotated[int, Opt(help="Spread the engines over K processes.")] = 1,
        prefill: Annotated[int, Opt(help="How many engines are prefill role.")] = 0,
        decode: Annotated[int, Opt(help="How many engines are decode role.")] = 0,
        kv_events_base_port: Annotated[int | None, Opt(help="First ZMQ PUB port.")] = None,
        config: Annotated[Path | None, Opt(help="YAML: 'mock' section for every engine.")] = None,
        flavor: Annotated[str | None, Opt(help="vllm or sglang.")] = None,
        model: Annotated[str | None, Opt(help="Served model name.")] = None,
        dp_size: Annotated[int | None, Opt(help="DP ranks per engine.")] = None,
        dp_external: Annotated[bool | None, Opt(help="One port per DP rank.")] = None,
        num_gpu_blocks: Annotated[int | None, Opt(help="KV blocks per rank.")] = None,
        speed: Annotated[float | None, Opt(help="Time compression factor.")] = None,
        seed: Annotated[int | None, Opt(help="Random seed (engine i gets seed+i).")] = None,
        kv_events_encoding: Annotated[str | None, Opt(help="array or map.")] = None,
        spec_json: Annotated[str | None, Opt(hidden=True)] = None,
    ) -> None:
        """Run many mock engines (one process or K), print a JSON description, serve forever."""
        from mockengine.fleet import plan_fleet, run_fleet, run_specs

        if spec_json is not None:
            run_specs(spec_json)
            return
        flags = {
            "flavor": flavor,
            "model": model,
            "dp_size": dp_size,
            "dp_external": dp_external,
            "num_gpu_blocks": num_gpu_blocks,
            "speed": speed,
            "seed": seed,
            "kv_events_encoding": kv_events_encoding,
        }
        specs = plan_fleet(config, flags, count, base_port, prefill, decode, kv_events_base_port)
        run_fleet(specs, processes)
