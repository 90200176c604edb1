"""The mock engine's HTTP front: a raw ASGI app, lean enough never to be a benchmark's bottleneck.

No framework and no per-request models: the body is parsed once with orjson, only
the fields a real engine reads are looked at, and stream chunks are pre-encoded
(``openai_shapes.StreamEncoder``). One app serves one or more DP ranks of engines.

E/P/D follows vLLM's disaggregated-encoder proxy
(``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py``): the proxy sends
the chat request to the encoder with ``max_tokens=1``, ``stream=false`` and the
``x-request-id`` header; real vLLM then moves the encoder cache, keyed by the item's
``mm_hash``, through an EC connector. The mock encoder answers that request (or its own
shortcut ``POST /v1/encode`` with ``{"messages"}`` or ``{"images": [url, ...]}``) with
``ec_transfer_params = {mm_hash: {"num_encoder_tokens", "encoder_engine_id",
"encoder_host", "encoder_port"}}`` (``mm_hash``: first 32 hex of sha256 of the image
URL). A prefill or unified mock given ``ec_transfer_params`` skips the simulated vision
encoder for the images whose hash it carries; every other image costs
``encode_us_per_image`` (scaled by ``speed``). A decode leg fed remote KV encodes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from mockengine import openai_shapes as shapes
from mockengine.engine.api import EngineRequest, TokenOutput
from mockengine.engine.driver import RealClockEngine
from mockengine.faults import DropConnection, Faults
from mockengine.metrics import EngineMetrics
from mockengine.pd import Held, HeldKV, KVPuller, PullError
from mockengine.settings import MockSettings
from mockengine.tokenizer import ModelTokenizer, TemplateError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON = b"application/json"
SSE = b"text/event-stream"
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
EMBEDDING_DIM = 64
# What ``/version`` reports: the engine release whose API shapes the mock follows.
MOCK_VERSIONS = {"vllm": "0.10.1", "sglang": "0.5.0"}


class ClientError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(slots=True)
class Parsed:
    """What the engine needs from one completion or chat request."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    num_images: int
    num_encoded: int  # images whose encoder output arrives in ec_transfer_params
    kv_transfer_params: dict[str, Any] | None
    bootstrap: tuple[str, int, int] | None
    ec_transfer_params: dict[str, Any] | None
    cache_salt: str | None
    priority: int


@dataclass(slots=True)
class Plan:
    """How to run one request on one rank (P/D decisions included)."""

    rank: int
    request: EngineRequest
    prefill_hold: str  # "" | "vllm" | "sglang"
    room: int | None
    remote_prefilled: int


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    all_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        all_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def count_images(messages: list[Any]) -> int:
    n = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            n += sum(
                1 for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
            )
    return n


def image_refs(messages: list[Any]) -> list[str]:
    refs: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                ref = part.get(part["type"])
                if isinstance(ref, dict):
                    ref = ref.get("url", "")
                refs.append(str(ref))
    return refs


def mm_hash(ref: str) -> str:
    return hashlib.sha256(ref.encode()).hexdigest()[:32]


def embedding_of(token_ids: list[int]) -> list[float]:
    """A deterministic unit vector: token bag hashed into ``EMBEDDING_DIM`` buckets."""
    vec = [0.0] * EMBEDDING_DIM
    for t in token_ids:
        h = (t * 2654435761) & 0xFFFFFFFF
        vec[h % EMBEDDING_DIM] += 1.0 if (h >> 16) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


class EngineServer:
    """ASGI app over ``engines`` (DP rank → engine) with the flavour's API and metrics."""

    def __init__(
        self,
        settings: MockSettings,
        engines: dict[int, RealClockEngine],
        tokenizer: ModelTokenizer,
        faults: Faults,
        held: HeldKV,
        puller: KVPuller,
        metrics: EngineMetrics,
        port: int,
        inject_kv_gap: Callable[[int], None],
        drop_kv_events: Callable[[int], None],
    ) -> None:
        self.s = settings
        self.engines = engines
        self.tok = tokenizer
        self.faults = faults
        self.held = held
        self.puller = puller
        self.metrics = metrics
        self.port = port
        self.inject_kv_gap = inject_kv_gap
        self.drop_kv_events = drop_kv_events
        self.engine_id = settings.engine_id or f"mock-{settings.host}-{port}"
        self.inflight = dict.fromkeys(engines, 0)
        # As vLLM does at startup: a sequence must fit in one rank's KV cache.
        kv_tokens = min(e.config.num_gpu_blocks * e.config.block_size for e in engines.values())
        self.max_len = min(settings.max_model_len, kv_tokens)
        self.output_ids = [tokenizer.filler_token_id]
        self.created = int(time.time())
        self.routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics_endpoint,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("POST", "/v1/embeddings"): self.embeddings,
            ("POST", "/v1/encode"): self.encode,
            ("GET", "/admin/faults"): self.get_faults,
            ("POST", "/admin/faults"): self.set_faults,
            ("POST", "/internal/kv/pull"): self.kv_pull,
            ("POST", "/reset_prefix_cache"): self.reset_prefix_cache,
            ("GET", "/version"): self.version,
            ("GET", "/ping"): self.health,
            ("POST", "/ping"): self.health,
            ("GET", "/load"): self.load,
        }
        if settings.flavor == "sglang":
            self.routes.update(
                {
                    ("GET", "/health_generate"): self.health,
                    ("GET", "/get_model_info"): self.model_info,
                    ("POST", "/flush_cache"): self.reset_prefix_cache,
                    ("GET", "/flush_cache"): self.reset_prefix_cache,
                }
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await _lifespan(receive, send)
            return
        handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None:
            known = any(path == scope["path"] for _, path in self.routes)
            status = 405 if known else 404
            await respond(send, status, shapes.error_body(status, f"{scope['path']}: not found"))
            return
        await handler(scope, receive, send)

    # ---- control endpoints -------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", b"text/plain")

    async def load(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``GET /load`` (``--enable-server-load-tracking``): requests in flight."""
        await respond(send, 200, orjson.dumps({"server_load": sum(self.inflight.values())}))

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps({"version": MOCK_VERSIONS[self.s.flavor]}))

    async def model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's ``GET /get_model_info``."""
        info = {
            "model_path": self.s.model,
            "tokenizer_path": self.s.tokenizer,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        await respond(send, 200, orjson.dumps(info))

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = "vllm" if self.s.flavor == "vllm" else "sglang"
        card = {
            "id": self.s.model,
            "object": "model",
            "created": self.created,
            "owned_by": owner,
            "root": self.s.model,
            "parent": None,
            "max_model_len": self.max_len,
            "permission": [
                {
                    "id": f"modelperm-{os.urandom(8).hex()}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        await respond(send, 200, orjson.dumps({"object": "list", "data": [card]}))

    async def metrics_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = {r: e.stats() for r, e in self.engines.items()}
        body = self.metrics.render(stats)
        await respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        raw = await read_body(receive)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ClientError(400, f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise ClientError(400, "request body must be a JSON object")
        return data

    async def _guard(
        self,
        send: Send,
        work: Callable[[], Awaitable[tuple[int, bytes]]],
    ) -> None:
        try:
            status, body = await work()
        except ClientError as exc:
            status, body = exc.status, shapes.error_body(exc.status, str(exc), exc.param)
        await respond(send, status, body)

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            if "messages" in data:
                messages = data["messages"]
                if not isinstance(messages, list):
                    raise ClientError(400, "messages must be a list", "messages")
                try:
                    text = self.tok.render_chat(messages, data.get("add_generation_prompt", True))
                except TemplateError as exc:
                    raise ClientError(400, str(exc), "messages") from exc
            elif isinstance(data.get("prompt"), str):
                text = data["prompt"]
            else:
                raise ClientError(400, "either prompt (string) or messages is required", "prompt")
            ids = self.tok.encode(text)
            out: dict[str, Any] = {
                "count": len(ids),
                "max_model_len": self.max_len,
                "tokens": ids,
                "token_strs": self.tok.token_strings(ids)
                if data.get("return_token_strs")
                else None,
            }
            return 200, orjson.dumps(out)

        await self._guard(send, work)

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ClientError(400, "tokens must be a list of integers", "tokens")
            if any(t < 0 or t >= self.tok.vocab_size for t in tokens):
                raise ClientError(400, "token id out of vocabulary", "tokens")
            return 200, orjson.dumps({"prompt": self.tok.decode(tokens)})

        await self._guard(send, work)

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            raw = data.get("input")
            if isinstance(raw, str) or (raw and isinstance(raw, list) and isinstance(raw[0], int)):
                inputs: list[Any] = [raw]
            elif isinstance(raw, list) and raw:
                inputs = raw
            else:
                raise ClientError(400, "input must be a string, token list or a list of them")
            rows, total = [], 0
            for i, item in enumerate(inputs):
                if isinstance(item, str):
                    ids = self.tok.encode(item)
                elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                    ids = item
                else:
                    raise ClientError(400, f"input[{i}] must be a string or a token list", "input")
                total += len(ids)
                rows.append({"index": i, "object": "embedding", "embedding": embedding_of(ids)})
            body = {
                "id": f"embd-{os.urandom(16).hex()}",
                "object": "list",
                "created": int(time.time()),
                "model": self.s.model,
                "data": rows,
                "usage": {
                    "prompt_tokens": total,
                    "total_tokens": total,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
            return 200, orjson.dumps(body)

        await self._guard(send, work)

    async def reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``POST /reset_prefix_cache`` on every rank; 409 while blocks are in use."""
        await read_body(receive)
        refused = [r for r, e in self.engines.items() if not e.reset_prefix_cache()]
        if refused:
            message = f"prefix cache not reset on ranks {refused}: blocks in use"
            await respond(send, 409, shapes.error_body(409, message))
            return
        await respond(send, 200, b"", b"text/plain")

    async def get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.faults.describe()))

    async def set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            gap, drop = data.pop("kv_gap", 0), data.pop("kv_drop", 0)
            for key, n in (("kv_gap", gap), ("kv_drop", drop)):
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise ClientError(400, f"{key} must be a non-negative integer", key)
            try:
                self.faults.update(data)
            except ValueError as exc:
                raise ClientError(400, str(exc)) from exc
            if gap:
                self.inject_kv_gap(gap)
                self.metrics.fault("kv_gap")
            if drop:
                self.drop_kv_events(drop)
                self.metrics.fault("kv_drop")
            return 200, orjson.dumps(self.faults.describe())

        await self._guard(send, work)

    async def kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM-flow stand-in for the NIXL read: release a prefill's held blocks."""

        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            rid = data.get("request_id")
            if not isinstance(rid, str):
                raise ClientError(400, "request_id is required", "request_id")
            return self.release(rid)

        await self._guard(send, work)

    def release(self, request_id: str) -> tuple[int, bytes]:
        held = self.held.take(request_id)
        if held is None:
            raise ClientError(404, f"no held KV for request {request_id} (expired or pulled)")
        return 200, self._released(request_id, held)

    def _released(self, request_id: str, held: Held) -> bytes:
        self.engines[held.rank].release_held(request_id)
        self.metrics.ranks[held.rank].kv_pulls_served += 1
        return orjson.dumps(
            {
                "request_id": request_id,
                "num_tokens": held.num_tokens,
                "block_ids": held.block_ids,
                "dp_rank": held.rank,
            }
        )

    async def bootstrap_pull(self, data: dict[str, Any]) -> tuple[int, bytes]:
        """SGLang-flow: wait for the room's prefill and release its blocks."""
        room = data.get("room")
        timeout_s = data.get("timeout_s", self.s.pd_wait_timeout_s)
        if not isinstance(room, int) or not isinstance(timeout_s, int | float):
            raise ClientError(400, "room (int) and timeout_s (number) are required", "room")
        try:
            rid, held = await self.held.take_room(room, float(timeout_s))
        except PullError as exc:
            raise ClientError(exc.status, str(exc)) from exc
        return 200, self._released(rid, held)

    # ---- encode role (E/P/D) -----------------------------------------------------------

    def _encode_params(self, refs: list[str]) -> dict[str, Any]:
        """vLLM's ``ec_transfer_params``: one entry per image hash (``num_encoder_tokens``)."""
        per_image_tokens = 256
        return {
            mm_hash(ref): {
                "num_encoder_tokens": per_image_tokens,
                "encoder_engine_id": self.engine_id,
                "encoder_host": self.s.host,
                "encoder_port": self.port,
            }
            for ref in refs
        }

    async def _encode_delay(self, num_images: int) -> None:
        if num_images:
            await asyncio.sleep(num_images * self.s.encode_us_per_image / 1e6 / self.s.speed)

    async def encode(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/encode`` ``{"messages"}`` or ``{"images": [url...]}``: simulated ViT."""

        async def work() -> tuple[int, bytes]:
            data = await self._json_body(receive)
            if isinstance(data.get("images"), list):
                refs = [str(u) for u in data["images"]]
            elif isinstance(data.get("messages"), list):
                refs = image_refs(data["messages"])
            else:
                raise ClientError(400, "messages or images is required", "messages")
            await self._encode_delay(len(refs))
            body = {
                "id": f"enc-{os.urandom(16).hex()}",
                "object": "encode",
                "model": self.s.model,
                "num_images": len(refs),
                "ec_transfer_params": self._encode_params(refs),
            }
            return 200, orjson.dumps(body)

        await self._guard(send, work)

    # ---- generation --------------------------------------------------------------------

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    def _parse(self, data: dict[str, Any], chat: bool) -> Parsed:
        model = data.get("model")
        if model is not None and model != self.s.model:
            raise ClientError(404, f"The model `{model}` does not exist.", "model")
        n = data.get("n", 1)
        if n != 1:
            raise ClientError(400, "only n=1 is supported by the mock engine", "n")
        num_images = 0
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ClientError(400, "messages must be a non-empty list", "messages")
            try:
                prompt_ids = self.tok.tokenize_chat(messages)
            except TemplateError as exc:
                raise ClientError(400, str(exc), "messages") from exc
            num_images = count_images(messages)
            max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        else:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                prompt_ids = self.tok.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = prompt
            else:
                raise ClientError(
                    400, "prompt must be a non-empty string or token list (one prompt)", "prompt"
                )
            max_tokens = data.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.s.default_max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ClientError(400, "max_tokens must be a positive integer", "max_tokens")
        if len(prompt_ids) + max_tokens > self.max_len:
            raise ClientError(
                400,
                f"This model's maximum context length is {self.max_len} tokens. "
                f"However, you requested {len(prompt_ids) + max_tokens} tokens "
                f"({len(prompt_ids)} in the messages, {max_tokens} in the completion).",
            )
        stream = bool(data.get("stream", False))
        opts = data.get("stream_options") or {}
        if opts and not stream:
            raise ClientError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        kvp = data.get("kv_transfer_params")
        room = data.get("bootstrap_room")
        bootstrap = None
        if room is not None:
            host, port = data.get("bootstrap_host"), data.get("bootstrap_port")
            if not isinstance(room, int) or not isinstance(host, str) or not isinstance(port, int):
                raise ClientError(
                    400, "bootstrap_host (str), bootstrap_port and bootstrap_room (int) required"
                )
            bootstrap = (host, port, room)
        ecp = data.get("ec_transfer_params")
        num_encoded = 0
        if num_images and isinstance(ecp, dict):
            num_encoded = sum(1 for ref in image_refs(data["messages"]) if mm_hash(ref) in ecp)
        salt = data.get("cache_salt")
        priority = data.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ClientError(400, "priority must be an integer", "priority")
        return Parsed(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=bool(opts.get("include_usage")) if isinstance(opts, dict) else False,
            continuous_usage=bool(opts.get("continuous_usage_stats"))
            if isinstance(opts, dict)
            else False,
            num_images=num_images,
            num_encoded=num_encoded,
            kv_transfer_params=kvp if isinstance(kvp, dict) else None,
            bootstrap=bootstrap,
            ec_transfer_params=ecp if isinstance(ecp, dict) else None,
            cache_salt=salt if isinstance(salt, str) and salt else None,
            priority=priority,
        )

    def _pick_rank(self, scope: Scope) -> int:
        raw = _header(scope, b"x-data-parallel-rank")
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                raise ClientError(400, "X-data-parallel-rank must be an integer") from None
            if rank not in self.engines:
                raise ClientError(
                    400, f"X-data-parallel-rank {rank} not served here (ranks {list(self.engines)})"
                )
            return rank
        inflight = self.inflight
        if len(inflight) == 1:
            return next(iter(inflight))
        return min(inflight, key=inflight.__getitem__)

    async def _plan(self, scope: Scope, rid: str, p: Parsed) -> tuple[Plan, bytes]:
        """Decide rank and P/D behaviour; the decode side's KV pull happens here."""
        rank = self._pick_rank(scope)
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=p.prompt_ids,
            max_tokens=p.max_tokens,
            output_token_ids=self.output_ids,
            cache_salt=p.cache_salt,
            priority=p.priority,
        )
        plan = Plan(rank, req, "", None, 0)
        kvp = p.kv_transfer_params
        role = self.s.role
        if kvp and kvp.get("do_remote_decode"):
            req.max_tokens = 1
            req.hold_kv_after_prefill = True
            plan.prefill_hold = "vllm"
        elif kvp and kvp.get("do_remote_prefill"):
            try:
                await self.puller.pull_vllm(kvp, self.s.pd_wait_timeout_s)
                plan.remote_prefilled = len(p.prompt_ids)
            except PullError:
                # As vLLM with kv_load_failure_policy=recompute: prefill the prompt locally.
                self.metrics.ranks[rank].kv_pull_failures += 1
        elif p.bootstrap is not None and role == "prefill":
            req.max_tokens = 1
            req.hold_kv_after_prefill = True
            plan.prefill_hold = "sglang"
            plan.room = p.bootstrap[2]
        elif p.bootstrap is not None and role == "decode":
            host, port, room = p.bootstrap
            try:
                await self.puller.pull_sglang(host, port, room, self.s.pd_wait_timeout_s)
            except PullError as exc:
                raise ClientError(exc.status, str(exc)) from exc
            plan.remote_prefilled = len(p.prompt_ids)
        req.remote_prefilled_tokens = plan.remote_prefilled
        if plan.remote_prefilled:
            self.metrics.ranks[rank].remote_prefills += 1
        if p.num_images and role != "encode" and not plan.remote_prefilled:
            # A remotely prefilled prompt arrives as KV: its images were encoded upstream.
            await self._encode_delay(p.num_images - p.num_encoded)
        return plan, str(plan.remote_prefilled).encode()

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        raw_rid = _header(scope, b"x-request-id")
        rid = raw_rid.decode("latin-1") if raw_rid else os.urandom(16).hex()
        rid_header = (b"x-request-id", rid.encode("latin-1"))
        start = time.perf_counter()
        body = await read_body(receive)
        if self.faults.active:
            stop = await self._inject(receive, send, rid_header)
            if stop:
                return
        try:
            data = orjson.loads(body)
            if not isinstance(data, dict):
                raise ClientError(400, "request body must be a JSON object")
            parsed = self._parse(data, chat)
            if self.s.role == "encode" and chat:
                await self._encode_chat(send, rid, data, rid_header)
                return
            plan, remote = await self._plan(scope, rid, parsed)
        except orjson.JSONDecodeError as exc:
            await respond(send, 400, shapes.error_body(400, f"invalid JSON body: {exc}"))
            return
        except ClientError as exc:
            await respond(
                send,
                exc.status,
                shapes.error_body(exc.status, str(exc), exc.param),
                JSON,
                [rid_header],
            )
            return
        headers = [rid_header, (b"x-data-parallel-rank", str(plan.rank).encode())]
        if plan.remote_prefilled:
            headers.append((b"x-mock-remote-prefill-tokens", remote))
        run = _Run(self, plan, parsed, chat, rid, start, headers, send)
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, run, task))
        self.inflight[plan.rank] += 1
        try:
            await run.go()
        except DropConnection:
            # Returning with the response unfinished makes the server cut the connection.
            return
        except asyncio.CancelledError:
            if not run.disconnected or task is None:
                raise
            task.uncancel()
        finally:
            self.inflight[plan.rank] -= 1
            run.done = True
            watcher.cancel()

    async def _inject(self, receive: Receive, send: Send, rid_header: tuple[bytes, bytes]) -> bool:
        """Apply request-level faults; True when the request was answered (or swallowed)."""
        faults = self.faults
        if faults.should_crash():
            sys.stderr.write(f"mock engine: crash fault after {faults.crash_after} requests\n")
            sys.stderr.flush()
            os._exit(3)
        status = faults.error_status()
        if status is not None:
            self.metrics.fault("error")
            body = shapes.error_body(status, f"injected fault: HTTP {status}")
            await respond(send, status, body, JSON, [rid_header])
            return True
        if faults.should_hang():
            self.metrics.fault("hang")
            while (await receive())["type"] != "http.disconnect":
                continue
            return True
        delay = faults.latency_s()
        if delay:
            self.metrics.fault("latency")
            await asyncio.sleep(delay)
        return False

    async def _encode_chat(
        self, send: Send, rid: str, data: dict[str, Any], rid_header: tuple[bytes, bytes]
    ) -> None:
        """Encode role on the chat route (vLLM EPD proxy style): encode, answer no text."""
        refs = image_refs(data["messages"])
        await self._encode_delay(len(refs))
        body = orjson.loads(
            shapes.chat_body(
                rid, int(time.time()), self.s.model, "", "length", shapes.usage(0, 0, 0), None
            )
        )
        body["ec_transfer_params"] = self._encode_params(refs)
        await respond(send, 200, orjson.dumps(body), JSON, [rid_header])


async def _watch_disconnect(receive: Receive, run: _Run, task: asyncio.Task[Any] | None) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue
    if not run.done and task is not None:
        run.disconnected = True
        task.cancel()


class _Run:
    """One request's generation: drives the engine iterator and writes the response."""

    __slots__ = (
        "app",
        "plan",
        "p",
        "chat",
        "rid",
        "start",
        "headers",
        "send",
        "done",
        "disconnected",
    )

    def __init__(
        self,
        app: EngineServer,
        plan: Plan,
        parsed: Parsed,
        chat: bool,
        rid: str,
        start: float,
        headers: list[tuple[bytes, bytes]],
        send: Send,
    ) -> None:
        self.app = app
        self.plan = plan
        self.p = parsed
        self.chat = chat
        self.rid = rid
        self.start = start
        self.headers = headers
        self.send = send
        self.done = False
        self.disconnected = False

    async def go(self) -> None:
        app, plan, p = self.app, self.plan, self.p
        engine = app.engines[plan.rank]
        try:
            agen = engine.generate(plan.request)
        except ValueError:
            # The client reused a request id still in flight here: keep both apart.
            plan.request.request_id = f"{self.rid}-{os.urandom(4).hex()}"
            agen = engine.generate(plan.request)
        rm = app.metrics.ranks[plan.rank]
        created = int(time.time())
        model = app.s.model
        send = self.send
        n_prompt = len(p.prompt_ids)
        enc = shapes.StreamEncoder(self.chat, self.rid, created, model) if p.stream else None
        if enc is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", SSE),
                        (b"cache-control", b"no-cache"),
                        *self.headers,
                    ],
                }
            )
            first = enc.first(shapes.usage(n_prompt, 0, 0) if p.continuous_usage else None)
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
        faults = app.faults
        slow = faults.slow_stream_ms / 1000.0 if p.stream else 0.0
        drop_at = faults.drop_at() if p.stream and faults.drop_after_tokens else 0
        generated = 0
        cached = 0
        last = self.start
        out: TokenOutput | None = None
        reason = "length"
        try:
            async for out in agen:
                delta = out.num_generated - generated
                if out.num_cached_tokens > 0:
                    cached = out.num_cached_tokens
                if delta <= 0 and not out.finished:
                    continue
                now = time.perf_counter()
                if generated == 0 and delta > 0:
                    rm.ttft.observe(now - self.start)
                elif delta > 0:
                    rm.itl.observe((now - last) / delta, delta)
                last = now
                generated = out.num_generated
                if out.finished:
                    reason = out.finish_reason or "length"
                if enc is None:
                    continue
                if slow:
                    await asyncio.sleep(slow)
                use = shapes.usage(n_prompt, generated, cached) if p.continuous_usage else None
                fin = ("length" if reason == "length" else reason) if out.finished else None
                chunk = enc.chunk(delta, fin, use)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if drop_at and generated >= drop_at and not out.finished:
                    app.metrics.fault("drop")
                    raise DropConnection(f"injected drop after {generated} tokens")
        finally:
            if out is None or not out.finished:
                await agen.aclose()
                rm.finished["abort"] += 1
        rm.e2e.observe(time.perf_counter() - self.start)
        rm.finished[reason if reason in rm.finished else "error"] += 1
        kvp = self._finish_pd(out)
        use = shapes.usage(n_prompt, generated, cached)
        if enc is not None:
            tail = (enc.usage_chunk(use) if p.include_usage else b"") + shapes.DONE
            self.done = True
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        text = shapes.filler(generated).decode()
        build = shapes.chat_body if self.chat else shapes.completion_body
        body = build(self.rid, created, model, text, reason, use, kvp)
        self.done = True
        await respond(send, 200, body, JSON, self.headers)

    def _finish_pd(self, out: TokenOutput | None) -> dict[str, Any] | None:
        plan, app = self.plan, self.app
        if not plan.prefill_hold or out is None:
            return None
        held = Held(plan.rank, list(out.held_block_ids), len(self.p.prompt_ids))
        engine_rid = plan.request.request_id
        app.held.hold(engine_rid, held, plan.room)
        if plan.prefill_hold != "vllm":
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": app.engine_id,
            "remote_block_ids": held.block_ids,
            "remote_host": app.s.host,
            "remote_port": app.port,
            "remote_request_id": engine_rid,
            "tp_size": 1,
        }


async def _lifespan(receive: Receive, send: Send) -> None:
    """Engines are started by the launcher, so lifespan only acknowledges."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class BootstrapServer:
    """SGLang's bootstrap port on a prefill mock: ``/health`` and ``POST /bootstrap/pull``."""

    def __init__(self, engine_server: EngineServer) -> None:
        self.engine_server = engine_server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await respond(send, 200, b"", b"text/plain")
            return
        if (scope["method"], scope["path"]) != ("POST", "/bootstrap/pull"):
            await respond(send, 404, shapes.error_body(404, f"{scope['path']}: not found"))
            return
        es = self.engine_server

        async def work() -> tuple[int, bytes]:
            return await es.bootstrap_pull(await es._json_body(receive))

        await es._guard(send, work)
