"""Hash parity on real vLLM: the router's canary is verified with our tokenizer and chat
template, and ``switchyard doctor`` says so (exit 0), or names the template when it
differs (exit 1)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from switchyard.cli.main import run
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.parity import ParityChecker, ParityResult
from tests.real.conftest import MODEL
from tests.support import TOKENIZER_DIR
from tools.realvllm import BLOCK_SIZE, VllmEngine


def check(url: str) -> ParityResult:
    """The router's parity check of ``url`` from a store that found its events itself."""

    async def go() -> ParityResult:
        store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
        follower = store.follow_workers([url])
        await store.start()
        try:
            await follower.wait()
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient() as client:
                return await ParityChecker(store).check(client, url, MODEL)
        finally:
            await store.stop()

    return asyncio.run(go())


def test_the_canary_is_verified_on_real_vllm_in_its_block_size(pair: list[VllmEngine]) -> None:
    result = check(pair[0].url)
    assert result.ok is True, result
    assert result.block_size == BLOCK_SIZE
    assert result.engine_prompt_tokens == result.router_tokens
    full = result.router_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert result.event_tokens == result.predicted_cached_tokens == full
    assert result.engine_cached_tokens is not None
    assert abs(result.engine_cached_tokens - full) <= BLOCK_SIZE


def other_template(tmp_path: Path) -> Path:
    out = tmp_path / "tokenizer-colon"
    shutil.copytree(TOKENIZER_DIR, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    changed = config["chat_template"].replace("message['role'] + '\\n'", "message['role'] + ':\\n'")
    assert changed != config["chat_template"]
    config["chat_template"] = changed
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_doctor_exits_0_with_our_tokenizer_and_1_with_another_chat_template(
    pair: list[VllmEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workers = [arg for e in pair for arg in ("--worker", e.url)]
    assert run(["doctor", *workers, "--tokenizer", str(TOKENIZER_DIR)]) == 0
    report = capsys.readouterr().out
    assert report.count("parity:       verified") == len(pair)
    assert report.count(f"block size:   {BLOCK_SIZE} (events)") == len(pair)
    assert "flavour:      vllm" in report and "vllm:num_requests_running" in report
    assert (
        run(["doctor", "--worker", pair[0].url, "--tokenizer", str(other_template(tmp_path))]) == 1
    )
    assert "likely cause: chat template" in capsys.readouterr().out
