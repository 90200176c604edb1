"""``switchyard simulate`` refuses what no engine can hold, as vLLM's API does, and goes on;
its engines are a realistic 8B engine unless told otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from switchyard.loadtest.simulate import SimConfig, simulate
from switchyard.mock.settings import MockSettings

# (arrival ms, prompt tokens, output tokens); the second is over Llama-3.1-8B's 131,072.
ROWS = [(0, 1000, 8), (100, 140_000, 8), (200, 1200, 8), (300, 900, 8)]


def trace(tmp_path: Path, rows: list[tuple[int, int, int]]) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = []
    for k, (ts, prompt, out) in enumerate(rows):
        blocks = list(range(k * 1000, k * 1000 + -(-prompt // 512)))
        lines.append(
            json.dumps(
                {"timestamp": ts, "input_length": prompt, "output_length": out, "hash_ids": blocks}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def config(tmp_path: Path, **overrides: object) -> SimConfig:
    cfg = SimConfig(
        engines=2,
        workload="mooncake",
        workload_params={"trace": str(trace(tmp_path, ROWS))},
        policies=["kv_aware", "round_robin"],
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_the_default_engine_is_an_8b_model_on_one_80gb_gpu(tmp_path: Path) -> None:
    engine = config(tmp_path).engine()
    assert (engine.num_gpu_blocks, engine.block_size) == (29_000, 16)
    assert engine.max_len == MockSettings().max_model_len == 131_072


def test_an_over_long_request_is_refused_and_the_run_goes_on(tmp_path: Path) -> None:
    outcome = simulate(config(tmp_path))
    assert outcome.refused_too_long == 1
    for run in outcome.runs:
        assert run.refused_too_long == 1
        assert (run.summary.ok, run.summary.errors) == (3, 1)
        assert run.decisions == 3  # the refused one never reached the router
        assert run.summary.error_samples == [
            "400: prompt + max_tokens over the 131072-token context"
        ]
    headline = outcome.headline()
    assert headline["refused_too_long"] == 1
    assert headline["engine"] == {
        "num_gpu_blocks": 29_000,
        "block_size": 16,
        "max_model_len": 131_072,
    }
    assert {p["refused_too_long"] for p in headline["policies"].values()} == {1}


def test_a_small_kv_cache_caps_the_context(tmp_path: Path) -> None:
    # 80 blocks of 16, less the null block: 1264 tokens; 1200 + 8 fits, 1000 + 8 fits.
    outcome = simulate(config(tmp_path, num_gpu_blocks=80, policies=["round_robin"]))
    assert outcome.engine.max_len == 79 * 16
    assert outcome.engine.describe() == (
        "80 KV blocks of 16 tokens per engine, max model len 1264 "
        "(one engine's KV cache; 131072 configured)"
    )
    assert outcome.refused_too_long == 1
    outcome = simulate(config(tmp_path, num_gpu_blocks=70, policies=["round_robin"]))
    assert outcome.engine.max_len == 69 * 16  # 1104: the 1200-token prompt is refused too
    assert outcome.refused_too_long == 2
    assert outcome.runs[0].summary.ok == 2


def test_max_model_len_is_the_served_context_when_the_cache_holds_it(tmp_path: Path) -> None:
    outcome = simulate(config(tmp_path, max_model_len=1000, policies=["round_robin"]))
    # Only the 900-token prompt leaves room for its 8 output tokens.
    assert outcome.engine.max_len == 1000
    assert outcome.refused_too_long == 3
    assert outcome.runs[0].summary.ok == 1


def test_a_pd_fleet_refuses_the_same_requests(tmp_path: Path) -> None:
    outcome = simulate(config(tmp_path, engines=2, prefill_engines=1, policies=["kv_aware"]))
    run = outcome.runs[0]
    assert run.refused_too_long == 1
    assert (run.summary.ok, run.summary.errors) == (3, 1)


def test_the_command_names_the_engine_and_the_refusals(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from switchyard.loadtest.simcli import simulate_command

    path = trace(tmp_path, ROWS)
    args = ["--engines", "2", "--workload", "mooncake", "--trace", str(path)]
    args += ["--policy", "round_robin", "--json"]
    result = CliRunner().invoke(simulate_command, args)
    assert result.exit_code == 0, result.output
    assert "engine: 29000 KV blocks of 16 tokens per engine, max model len 131072" in result.output
    assert "1 request(s) refused" in result.output
    headline = json.loads(result.output.strip().splitlines()[-1])
    assert headline["refused_too_long"] == 1
    assert headline["engine"]["max_model_len"] == 131_072


def test_the_command_leaves_the_router_loggers_level_as_it_found_it(tmp_path: Path) -> None:
    import logging

    from click.testing import CliRunner

    from switchyard.loadtest.simcli import simulate_command

    router_log = logging.getLogger("switchyard.router")
    router_log.setLevel(logging.INFO)
    try:
        args = ["--engines", "2", "--workload", "mooncake", "--trace", str(trace(tmp_path, ROWS))]
        result = CliRunner().invoke(simulate_command, [*args, "--policy", "round_robin"])
        assert result.exit_code == 0, result.output
        assert router_log.level == logging.INFO  # other code in this process still logs
    finally:
        router_log.setLevel(logging.NOTSET)
