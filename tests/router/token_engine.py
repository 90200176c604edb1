"""A deterministic engine in vLLM's streamed wire format, for migration tests.

Each next token is a function of the whole sequence so far (prompt and generated ids), so
a continuation from the right token ids gives exactly the rest of the uninterrupted answer,
and one from the wrong ids does not. Streams come in vLLM's shapes: a completion's chunks
carry ``prompt_token_ids`` (first chunk) and ``token_ids`` in each choice, a chat's
``prompt_token_ids`` beside its role chunk and ``token_ids`` in each choice, all null
without ``return_token_ids``; ``stream_options.include_usage`` adds the usage chunk before
``[DONE]``. Prompts are text (one token a word), token ids, or chat messages.

``faults`` script what the next streamed requests meet: the connection cut, an error event
or a stall after so many chunks.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from tests.router.stub_backend import StubBackend, StubReply, StubRequest, _Cut

MODEL = "stub-model"
MAX_MODEL_LEN = 512
EOS = 2
_VOCAB = 5000


def tokenize(text: str) -> list[int]:
    return [10 + zlib.crc32(word.encode()) % _VOCAB for word in text.split()]


def render(messages: list[dict[str, Any]]) -> list[int]:
    """The chat template: a begin token, each message framed, the assistant's turn open."""
    ids = [1]
    for message in messages:
        ids += [3, *tokenize(message["role"]), *tokenize(str(message["content"])), 4]
    return [*ids, 3, *tokenize("assistant")]


def next_token(seq: list[int]) -> int:
    return 10 + (sum(seq[-4:]) * 7 + len(seq) * 13) % _VOCAB


def text_of(token: int) -> str:
    return "" if token == EOS else f" w{token}"


@dataclass
class Fault:
    kind: str  # "cut", "error" or "stall"
    after: int  # chunks sent before it


@dataclass
class TokenEngine:
    faults: list[Fault] = field(default_factory=list)
    eos_at: int | None = None  # the sequence length at which EOS comes (finish "stop")
    interval_s: float = 0.001
    bodies: list[dict[str, Any]] = field(default_factory=list)  # streamed requests, in order
    stub: StubBackend = field(init=False)

    def __post_init__(self) -> None:
        self.stub = StubBackend(route=self.route)

    @property
    def url(self) -> str:
        return self.stub.url

    async def __aenter__(self) -> TokenEngine:
        await self.stub.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stub.close()

    def start(self) -> TokenEngine:
        """Serve from a thread of its own, for a router that is a process."""
        self.stub.start()
        return self

    def stop(self) -> None:
        self.stub.stop()

    async def route(self, request: StubRequest) -> StubReply | None:
        chat = request.path == "/v1/chat/completions"
        if request.method != "POST" or not (chat or request.path == "/v1/completions"):
            return None
        data = request.json()
        if not data.get("stream"):
            return None
        self.bodies.append(data)
        if chat:
            prompt = render(data["messages"])
            limit = data.get("max_completion_tokens", data.get("max_tokens"))
        else:
            raw = data["prompt"]
            prompt = list(raw) if isinstance(raw, list) else tokenize(raw)
            limit = data.get("max_tokens", 16)
        if limit is None:
            limit = MAX_MODEL_LEN - len(prompt)
        fault = self.faults.pop(0) if self.faults else None
        return StubReply(
            content_type="text/event-stream", stream=self._events(data, chat, prompt, limit, fault)
        )

    async def _events(
        self, data: dict[str, Any], chat: bool, prompt: list[int], limit: int, fault: Fault | None
    ) -> AsyncIterator[bytes]:
        ids = data.get("return_token_ids") is True
        options = data.get("stream_options") or {}
        kind = "chat.completion.chunk" if chat else "text_completion"
        envelope = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{time.monotonic_ns()}",
            "object": kind,
            "created": int(time.time()),
            "model": data["model"],
        }
        sent = 0

        async def emitted(chunk: dict[str, Any]) -> bytes:
            nonlocal sent
            if fault is not None and sent == fault.after:
                if fault.kind == "cut":
                    raise _Cut
                if fault.kind == "stall":
                    await asyncio.sleep(3600)
            sent += 1
            await asyncio.sleep(self.interval_s)
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        if chat:
            yield await emitted(
                {
                    **envelope,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": prompt if ids else None,
                    "prompt_text": None,
                }
            )
        seq = list(prompt)
        generated = 0
        while generated < limit:
            if fault is not None and fault.kind == "error" and sent == fault.after:
                error = {
                    "error": {
                        "object": "error",
                        "message": "EngineCore encountered an issue.",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                yield b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"
                return
            token = EOS if self.eos_at is not None and len(seq) == self.eos_at else next_token(seq)
            seq.append(token)
            generated += 1
            finish = "stop" if token == EOS else "length" if generated == limit else None
            choice: dict[str, Any]
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": text_of(token)},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                if finish is not None:
                    choice["stop_reason"] = None
                choice["token_ids"] = [token] if ids else None
            else:
                choice = {
                    "index": 0,
                    "text": text_of(token),
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_token_ids": (prompt if ids else None) if generated == 1 else None,
                    "token_ids": [token] if ids else None,
                }
            yield await emitted({**envelope, "choices": [choice]})
            if finish is not None:
                break
        if options.get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + generated,
                "completion_tokens": generated,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            yield b"data: " + orjson.dumps({**envelope, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"
