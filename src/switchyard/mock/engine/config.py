"""The engine model's knobs: capacity, scheduler limits and the step-time model.

Timing defaults are the BLIS fit for Llama-3.1-8B-Instruct on one H100 (TP=1) with
vLLM v0.8.4, from inference-sim/inference-sim ``defaults.yaml`` (``models`` entry
``meta-llama/llama-3.1-8b-instruct``, GPU H100, tensor_parallelism 1):
``beta_coeffs = [5752.705, 17.2509, 5.99914]`` µs and ``total_kv_blocks = 29205``.
BLIS models one engine step as ``beta0 + beta1 * uncached prefill tokens + beta2 *
decode tokens``; we keep those three terms and add two that the fit does not have
(derived below from the model's shape and the hardware, so they are estimates). BLIS's
``alpha_coeffs`` (API-server queueing/processing outside the GPU step) are not modelled.

The served context (``max_model_len``) is the HTTP front's and the simulator's setting, not
the core's: as in vLLM, a request longer than it is refused before it reaches the scheduler
(``api.context_length_error``), so the core only ever sees requests that fit.

Both flavours run the same vLLM V1-like scheduler: waiting requests first come, first
served, or with ``scheduling_policy="priority"`` by (``EngineRequest.priority``, arrival),
lower first, as vLLM's ``--scheduling-policy priority`` orders them (a preemption still
takes the request admitted last, not the lowest priority one as vLLM's does); ``hash_flavor``
picks how block hashes are computed and published. ``speed``
only matters on the real clock; the virtual clock runs in model time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HashFlavor = Literal["vllm", "sglang"]


@dataclass
class EngineConfig:
    block_size: int = 16
    # BLIS total_kv_blocks for this model/GPU is 29,205; rounded down.
    num_gpu_blocks: int = 29_000
    # vLLM V1 defaults for max_num_seqs and (online serving, H100) max_num_batched_tokens.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per-step token budget (chunked prefill)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # vLLM's --scheduling-policy
    enable_prefix_caching: bool = True
    # a: per-step fixed cost (BLIS beta0).
    step_base_us: float = 5753.0
    # b: per uncached prefill token scheduled in the step (BLIS beta1).
    prefill_token_us: float = 17.25
    # c: per decode sequence in the step (BLIS beta2).
    decode_token_us: float = 6.0
    # d: per context token attended by a sequence in the step. Not in the BLIS fit
    # (its beta2 absorbs an average context). Estimate: Llama-3.1-8B keeps
    # 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token; an
    # H100 reads HBM at ~3.35 TB/s, so attending one cached token costs ~0.04 µs.
    context_token_us: float = 0.04
    # P/D pull cost per block: 16 tokens x 128 KiB = 2 MiB per block over one
    # 400 Gb/s RDMA NIC (~50 GB/s) is ~42 µs.
    kv_transfer_us_per_block: float = 42.0
    # Prefill role: free blocks the decode side never pulled after this long.
    held_kv_timeout_s: float = 30.0
    # Time compression: wall time = model time / speed.
    speed: float = 1.0
    # For the server's randomised behaviour (faults); the engine model is deterministic.
    seed: int = 0
    hash_flavor: HashFlavor = "vllm"
    # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default on): publish uint64 hashes; off
    # publishes the raw 32-byte digests (msgpack bin). SGLang always publishes int64.
    int_block_hashes: bool = True
    # vLLM's --max-loras: adapters one step may run (0: LoRA off). An adapter a step needs
    # that is not in one of these GPU slots is loaded into one, evicting the least recently
    # used, and the step pays ``lora_load_us`` for it.
    max_loras: int = 0
    lora_load_us: float = 20_000.0

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one sequence can hold in this rank's KV cache: every block but vLLM's null
        block, so a longer sequence could never be scheduled."""
        return (self.num_gpu_blocks - 1) * self.block_size

    def context_limit(self, max_model_len: int) -> int:
        """The longest prompt + output this rank serves: the model's context, capped by the KV
        cache (vLLM refuses to start with a ``max_model_len`` its cache cannot hold; the mock
        serves the smaller instead)."""
        return min(max_model_len, self.kv_capacity_tokens)
