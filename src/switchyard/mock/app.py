"""The mock engine's HTTP front: one raw ASGI app over one or more DP ranks of engines.

No framework and no per-request models, so it is never a benchmark's bottleneck. This
module owns the routes and the small endpoints; the rest lives beside it: request
parsing (``request``), rank and P/D planning (``planning``), the E/P/D encoder
(``epd``), fault injection (``faults``), the stream loop (``stream``), SGLang's
bootstrap port (``bootstrap``), Anthropic Messages and OpenAI Responses over the chat path
(``apis``) and the ASGI plumbing (``asgi``).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from switchyard.mock import apis
from switchyard.mock import openai_shapes as shapes
from switchyard.mock.asgi import (
    JSON,
    TEXT,
    ClientError,
    guard,
    header,
    json_body,
    lifespan,
    not_found,
    read_body,
    respond,
    respond_error,
)
from switchyard.mock.engine.driver import RealClockEngine
from switchyard.mock.epd import Encoder
from switchyard.mock.faults import DropConnection, Faults, inject
from switchyard.mock.lora import Adapters, runtime_updating_allowed
from switchyard.mock.metrics import EngineMetrics
from switchyard.mock.pd import Held, HeldKV, KVPuller, PullError
from switchyard.mock.planning import Planner
from switchyard.mock.request import Limits, parse_request
from switchyard.mock.settings import MockSettings
from switchyard.mock.stream import Run, watch_disconnect
from switchyard.mock.tokenizer import ModelTokenizer, TemplateError

EMBEDDING_DIM = 64
# What ``/version`` reports: the engine release whose API shapes the mock follows.
MOCK_VERSIONS = {"vllm": "0.10.1", "sglang": "0.5.0"}


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
        # As vLLM does at startup: a sequence must fit in one rank's KV cache (less its null
        # block), so a request the API admits can always be scheduled.
        self.max_len = min(e.config.context_limit(settings.max_model_len) for e in engines.values())
        self.adapters = Adapters(settings.model, settings.lora_module_paths())
        self.limits = Limits(
            settings.model, settings.default_max_tokens, self.max_len, self.adapters.known
        )
        self.encoder = Encoder(settings, self.engine_id, port)
        self.planner = Planner(
            settings,
            engines,
            self.inflight,
            puller,
            held,
            metrics,
            self.encoder,
            self.engine_id,
            port,
            [tokenizer.filler_token_id],
        )
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
            ("POST", "/v1/encode"): self.encoder.encode,
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
        else:
            self.routes[("GET", "/kv_event_sources")] = self.kv_event_sources
            # vLLM's Anthropic and Responses routes, each answered over the chat path.
            self.responses = apis.Responses(self.chat_completions)
            self.routes[("POST", "/v1/messages")] = self.messages
            self.routes[("POST", "/v1/messages/count_tokens")] = self.count_tokens
            self.routes[("POST", "/v1/responses")] = self.responses.create
            if settings.lora_enabled and runtime_updating_allowed(settings.runtime_lora_updating):
                self.routes[("POST", "/v1/load_lora_adapter")] = self.load_lora_adapter
                self.routes[("POST", "/v1/unload_lora_adapter")] = self.unload_lora_adapter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await lifespan(receive, send)
            return
        handler = self.routes.get((scope["method"], scope["path"]))
        if (
            handler is None
            and scope["path"].startswith("/v1/responses/")
            and self.s.flavor == "vllm"
        ):
            handler = self.responses.retrieve
        if handler is None:
            known = any(path == scope["path"] for _, path in self.routes)
            await not_found(scope, send, 405 if known else 404)
            return
        await handler(scope, receive, send)

    # ---- control endpoints -------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", TEXT)

    async def load(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``GET /load`` (``--enable-server-load-tracking``): requests in flight."""
        await respond(send, 200, orjson.dumps({"server_load": sum(self.inflight.values())}))

    async def kv_event_sources(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``GET /kv_event_sources``: each served DP rank's events config, as vLLM
        reports a publisher started with ``tcp://*:PORT`` (ports offset by the rank)."""
        s = self.s
        out: dict[str, dict[str, Any]] = {}
        if s.kv_events_port is not None:
            for rank in sorted(self.engines):
                replay = s.kv_events_replay_port
                out[str(rank)] = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{s.kv_events_port + rank}",
                    "replay_endpoint": None if replay is None else f"tcp://*:{replay + rank}",
                    "buffer_steps": 10_000,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": s.kv_events_topic,
                }
        await respond(send, 200, orjson.dumps(out))

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
        permission: dict[str, Any] = {
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
        card = {
            "id": self.s.model,
            "object": "model",
            "created": self.created,
            "owned_by": owner,
            "root": self.s.model,
            "parent": None,
            "max_model_len": self.max_len,
            "permission": [permission],
        }
        adapters = self.adapters.cards(self.created, owner, permission)
        await respond(send, 200, orjson.dumps({"object": "list", "data": [card, *adapters]}))

    async def load_lora_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``POST /v1/load_lora_adapter``: a plain-text success line, or its error."""
        await self._adapter_route(receive, send, self.adapters.load)

    async def unload_lora_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._adapter_route(receive, send, self.adapters.unload)

    async def _adapter_route(
        self,
        receive: Receive,
        send: Send,
        action: Callable[[dict[str, Any]], tuple[int, bytes]],
    ) -> None:
        try:
            data = await json_body(receive)
        except ClientError as exc:
            await respond_error(send, exc)
            return
        status, body = action(data)
        await respond(send, status, body, TEXT if status == 200 else JSON)

    async def metrics_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = {r: e.stats() for r, e in self.engines.items()}
        body = self.metrics.render(stats)
        await respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
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

        await guard(send, work)

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
            tokens = data.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ClientError(400, "tokens must be a list of integers", "tokens")
            if any(t < 0 or t >= self.tok.vocab_size for t in tokens):
                raise ClientError(400, "token id out of vocabulary", "tokens")
            return 200, orjson.dumps({"prompt": self.tok.decode(tokens)})

        await guard(send, work)

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
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

        await guard(send, work)

    async def reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``POST /reset_prefix_cache`` on every rank; 409 while blocks are in use."""
        await read_body(receive)
        refused = [r for r, e in self.engines.items() if not e.reset_prefix_cache()]
        if refused:
            message = f"prefix cache not reset on ranks {refused}: blocks in use"
            await respond(send, 409, shapes.error_body(409, message))
            return
        await respond(send, 200, b"", TEXT)

    async def get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps(self.faults.describe()))

    async def set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
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

        await guard(send, work)

    async def kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM-flow stand-in for the NIXL read: release a prefill's held blocks."""

        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
            rid = data.get("request_id")
            if not isinstance(rid, str):
                raise ClientError(400, "request_id is required", "request_id")
            return self.release(rid)

        await guard(send, work)

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

    # ---- generation --------------------------------------------------------------------

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        await apis.messages(scope, receive, send, self.chat_completions)

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            data = await json_body(receive)
            model = data.get("model")
            if model != self.s.model and model not in self.adapters.known:
                raise ClientError(404, f"The model `{model}` does not exist.", "model")
            body = apis.count_tokens(data, lambda chat: len(self.tok.tokenize_chat(chat)))
        except (ClientError, TemplateError) as exc:
            error = exc if isinstance(exc, ClientError) else ClientError(400, str(exc))
            await respond(send, error.status, apis.anthropic_client_error(error))
            return
        await respond(send, 200, body)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        raw_rid = header(scope, b"x-request-id")
        rid = raw_rid.decode("latin-1") if raw_rid else os.urandom(16).hex()
        rid_header = (b"x-request-id", rid.encode("latin-1"))
        start = time.perf_counter()
        body = await read_body(receive)
        if self.faults.active:
            stop = await inject(self.faults, self.metrics, receive, send, rid_header)
            if stop:
                return
        try:
            data = orjson.loads(body)
            if not isinstance(data, dict):
                raise ClientError(400, "request body must be a JSON object")
            parsed = parse_request(data, chat, self.tok, self.limits)
            if self.s.role == "encode" and chat:
                await self.encoder.encode_chat(send, rid, data, rid_header)
                return
            plan, remote = await self.planner.plan(scope, rid, parsed)
        except orjson.JSONDecodeError as exc:
            await respond(send, 400, shapes.error_body(400, f"invalid JSON body: {exc}"))
            return
        except ClientError as exc:
            await respond_error(send, exc, [rid_header])
            return
        headers = [rid_header, (b"x-data-parallel-rank", str(plan.rank).encode())]
        if plan.remote_prefilled:
            headers.append((b"x-mock-remote-prefill-tokens", remote))
        run = Run(self, plan, parsed, chat, rid, start, headers, send)
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(watch_disconnect(receive, run, task))
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
