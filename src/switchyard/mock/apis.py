"""Anthropic Messages and OpenAI Responses, served as vLLM serves them: each request becomes
a chat completion, run as one, and its answer is rewritten into the API's shapes.

vLLM's ``/v1/messages`` converts the request to a chat request (``system`` becomes the
leading system message, one text block a string) and the chat stream back into
Anthropic's events (``message_start`` on the first chunk, a text block per run of text,
``message_delta`` with the stop reason and usage, ``message_stop``). Its ``/v1/responses``
renders ``instructions`` and ``input`` as chat messages, streams ``response.created`` and
``response.in_progress`` before any token, and keeps each answer for
``previous_response_id`` and ``GET /v1/responses/{id}`` (vLLM keeps them only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``; the mock always does, up to ``MAX_STORED``).
The goldens in ``tests/fixtures/apis`` pin the shapes.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from switchyard.mock.asgi import JSON, SSE, ClientError, json_body, respond, respond_error

# Responses answers kept for ``previous_response_id`` and GET; the oldest go first.
MAX_STORED = 10_000
_ANTHROPIC_STOP = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}

Generate = Callable[[Scope, Receive, Send], Awaitable[None]]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _chat_events(body: bytes) -> list[dict[str, Any] | None]:
    """The chat chunks of one piece of a chat stream (None for ``[DONE]``)."""
    out: list[dict[str, Any] | None] = []
    for line in body.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        out.append(None if data == b"[DONE]" else orjson.loads(data))
    return out


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` first, then the client's own messages (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _with_length(start: Message, length: int) -> Message:
    headers = [(k, v) for k, v in start.get("headers", ()) if k != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**start, "headers": headers}


# ---- Anthropic Messages ----------------------------------------------------------------


def _text_blocks(content: Any, where: str) -> list[str]:
    if not isinstance(content, list):
        raise ClientError(400, f"{where} must be a string or a list of content blocks", where)
    texts: list[str] = []
    for block in content:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ClientError(400, f"{where}: each block needs a string 'type'", where)
        text = block.get("text")
        if block["type"] == "text" and isinstance(text, str) and text:
            texts.append(text)
    return texts


def anthropic_chat_request(data: dict[str, Any], counting: bool = False) -> dict[str, Any]:
    """The chat request vLLM makes of a Messages request (text blocks only); ``counting``:
    of a count_tokens request, which has no ``max_tokens``."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, "messages must be a non-empty list", "messages")
    max_tokens = data.get("max_tokens", 1 if counting else None)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise ClientError(400, "max_tokens: Field required", "max_tokens")
    chat: list[dict[str, Any]] = []
    system = data.get("system")
    if system:
        texts = [system] if isinstance(system, str) else _text_blocks(system, "system")
        texts = [t for t in texts if not t.startswith("x-anthropic-billing-header")]
        if texts:
            chat.append({"role": "system", "content": "".join(texts)})
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ClientError(400, "each message needs role user, assistant or system", "messages")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        texts = _text_blocks(content, "messages")
        if role == "system":
            if texts:
                chat.append({"role": "system", "content": "".join(texts)})
        elif len(texts) == 1:
            chat.append({"role": role, "content": texts[0]})
        elif texts:
            chat.append({"role": role, "content": [{"type": "text", "text": t} for t in texts]})
    out: dict[str, Any] = {"messages": chat, "max_tokens": max_tokens}
    for key in ("model", "temperature", "top_p", "top_k", "cache_salt", "priority"):
        if key in data:
            out[key] = data[key]
    if data.get("stop_sequences"):
        out["stop"] = data["stop_sequences"]
    if data.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


def anthropic_usage(usage: dict[str, Any] | None, details: bool = True) -> dict[str, Any]:
    """vLLM's ``_build_anthropic_usage``: input tokens exclude the cached ones and those
    written to the cache (which the mock's chat usage does not count: 0). ``details``:
    the chat usage carried prompt token details (a stream's first chunk does not)."""
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = usage.get("prompt_tokens") or 0
    out: dict[str, Any] = {"output_tokens": usage.get("completion_tokens") or 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if details and cached is not None:
        out["cache_read_input_tokens"] = cached
        out["cache_creation_input_tokens"] = 0
        prompt -= cached
    return {"input_tokens": max(0, prompt), **out}


def anthropic_error(body: bytes) -> bytes:
    """vLLM's ``translate_error_response``: the chat error's type and message."""
    try:
        error = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        error = {}
    return orjson.dumps(
        {
            "type": "error",
            "error": {
                "type": error.get("type", "BadRequestError"),
                "message": error.get("message", ""),
            },
        }
    )


class AnthropicAnswer:
    """The chat answer, rewritten into a Messages answer (or its stream of events)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.status = 200
        self.stream = False
        self.started_message = False
        self.block_open = False
        self.finish: str | None = None
        self._body = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            self.status = message["status"]
            self.stream = any(
                k == b"content-type" and v.startswith(SSE) for k, v in message.get("headers", ())
            )
            if self.stream:
                await self.send(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream:
            out = b"".join(self._events(c) for c in _chat_events(body))
            await self.send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._body += body
        if more:
            return
        out = self._whole(self._body) if self.status == 200 else anthropic_error(self._body)
        assert self.start is not None
        await self.send(_with_length(self.start, len(out)))
        await self.send({"type": "http.response.body", "body": out})

    @staticmethod
    def _whole(body: bytes) -> bytes:
        chat = orjson.loads(body)
        choice = chat["choices"][0]
        text = choice["message"].get("content") or ""
        return orjson.dumps(
            {
                "id": chat["id"],
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "model": chat["model"],
                "stop_reason": _ANTHROPIC_STOP.get(choice["finish_reason"], "end_turn"),
                "usage": anthropic_usage(chat.get("usage")),
            }
        )

    def _events(self, chunk: dict[str, Any] | None) -> bytes:
        if chunk is None:
            return self._close_block() + _event("message_stop", {"type": "message_stop"})
        if not self.started_message:
            self.started_message = True
            message = {
                "id": chunk["id"],
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk["model"],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": anthropic_usage(chunk.get("usage"), details=False),
            }
            return _event("message_start", {"type": "message_start", "message": message})
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk
            stop = _ANTHROPIC_STOP.get(self.finish or "stop", "end_turn")
            return self._close_block() + _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": anthropic_usage(chunk.get("usage")),
                },
            )
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        text = (choice.get("delta") or {}).get("content")
        if not text:
            return b""
        out = b""
        if not self.block_open:
            self.block_open = True
            out = _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        delta = {"type": "text_delta", "text": text}
        return out + _event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def _close_block(self) -> bytes:
        if not self.block_open:
            return b""
        self.block_open = False
        return _event("content_block_stop", {"type": "content_block_stop", "index": 0})


async def messages(scope: Scope, receive: Receive, send: Send, generate: Generate) -> None:
    """``POST /v1/messages``."""
    try:
        chat = anthropic_chat_request(await json_body(receive))
    except ClientError as exc:
        await respond(send, exc.status, anthropic_client_error(exc))
        return
    await generate(scope, _replay(orjson.dumps(chat), receive), AnthropicAnswer(send))


def count_tokens(data: dict[str, Any], count: Callable[[list[dict[str, Any]]], int]) -> bytes:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the chat template renders
    it (``count``: the engine's chat tokenizer)."""
    tokens = count(anthropic_chat_request(data, counting=True)["messages"])
    return orjson.dumps(
        {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    )


def anthropic_client_error(exc: ClientError) -> bytes:
    return orjson.dumps(
        {"type": "error", "error": {"type": "BadRequestError", "message": str(exc)}}
    )


# ---- OpenAI Responses ------------------------------------------------------------------


@dataclass(slots=True)
class Stored:
    """One kept Responses answer: the chat it continued and the answer itself."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    """Answers by id, the oldest forgotten first."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._kept.get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        self._kept[response_id] = stored
        if len(self._kept) > self.limit:
            self._kept.popitem(last=False)


def _input_messages(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ClientError(400, "input must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ClientError(400, "the mock engine serves message items only", "input")
        content = item.get("content")
        if isinstance(content, list):
            texts = [p.get("text") or "" for p in content if isinstance(p, dict)]
            if item["role"] == "assistant":
                content = texts[0] if texts else ""
            else:
                content = [{"type": "text", "text": t} for t in texts]
        out.append({"role": item["role"], "content": content})
    return out


def _not_found(response_id: str) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": f"Response with id '{response_id}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
    )


class Responses:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` over the chat path."""

    def __init__(self, generate: Generate) -> None:
        self.generate = generate
        self.store = ResponseStore()

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            data = await json_body(receive)
            messages, chat = self._chat_request(data)
        except ClientError as exc:
            await respond_error(send, exc)
            return
        answer = ResponsesAnswer(send, data, messages, self.store)
        await self.generate(scope, _replay(orjson.dumps(chat), receive), answer)

    def _chat_request(self, data: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if "input" not in data:
            raise ClientError(400, "input: Field required", "input")
        messages: list[dict[str, Any]] = []
        instructions = data.get("instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        previous = data.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous)
            if stored is None:
                raise ClientError(404, f"Response with id '{previous}' not found.", "response_id")
            messages += [m for m in stored.messages if m["role"] != "system"]
            for item in stored.response["output"]:
                for part in item.get("content", ()):
                    messages.append({"role": "assistant", "content": part["text"]})
        messages += _input_messages(data["input"])
        chat: dict[str, Any] = {"messages": messages}
        for key in ("model", "temperature", "top_p", "cache_salt", "priority"):
            if key in data:
                chat[key] = data[key]
        if data.get("max_output_tokens") is not None:
            chat["max_tokens"] = data["max_output_tokens"]
        if data.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return messages, chat

    async def retrieve(self, scope: Scope, receive: Receive, send: Send) -> None:
        rest = scope["path"][len("/v1/responses/") :]
        response_id, _, action = rest.partition("/")
        stored = self.store.get(response_id)
        if stored is None:
            await respond(send, 404, _not_found(response_id))
        elif action == "cancel" and scope["method"] == "POST":
            error = ClientError(400, "Cannot cancel a synchronous response.")
            await respond_error(send, error)
        elif not action and scope["method"] == "GET":
            await respond(send, 200, orjson.dumps(stored.response))
        else:
            await respond(send, 405, b'{"detail":"Method Not Allowed"}', JSON)


class ResponsesAnswer:
    """The chat answer, rewritten into a Responses answer (or its stream of events)."""

    def __init__(
        self,
        send: Send,
        request: dict[str, Any],
        messages: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.send = send
        self.request = request
        self.messages = messages
        self.store = store
        rid = request.get("request_id")
        self.id = rid if isinstance(rid, str) and rid else f"resp_{os.urandom(16).hex()}"
        self.item_id = f"msg_{os.urandom(16).hex()}"
        self.created = int(time.time())
        self.start: Message | None = None
        self.status = 200
        self.stream = False
        self.seq = 0
        self.text: list[str] = []
        self.opened = False
        self.finish: str | None = None
        self._body = b""

    def response(
        self, model: str, status: str, usage: dict[str, Any] | None, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse.from_request`` as it dumps it."""
        r = self.request
        return {
            "background": r.get("background", False),
            "created_at": self.created,
            "ec_transfer_params": None,
            "frequency_penalty": r.get("frequency_penalty"),
            "id": self.id,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "input_messages": None,
            "instructions": r.get("instructions"),
            "kv_transfer_params": None,
            "model": model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "temperature": r.get("temperature", 1.0),
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools", []),
            "top_p": r.get("top_p", 1.0),
            "max_output_tokens": r.get("max_output_tokens"),
            "max_tool_calls": r.get("max_tool_calls"),
            "metadata": r.get("metadata"),
            "output_messages": None,
            "presence_penalty": r.get("presence_penalty"),
            "previous_response_id": r.get("previous_response_id"),
            "prompt": None,
            "reasoning": None,
            "service_tier": r.get("service_tier", "auto"),
            "status": status,
            "text": None,
            "top_logprobs": r.get("top_logprobs"),
            "truncation": r.get("truncation", "disabled"),
            "usage": usage,
            "user": r.get("user"),
        }

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {
            "id": self.item_id,
            "content": content,
            "phase": None,
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    @staticmethod
    def _part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
        """An output text part; vLLM's opening part has an empty list of logprobs."""
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    @staticmethod
    def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": details.get("cached_tokens") or 0,
                "cache_write_tokens": 0,  # not counted by the mock's chat usage
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": usage["total_tokens"],
        }

    def _done(self, model: str, usage: dict[str, Any] | None, text: str) -> dict[str, Any]:
        status = "incomplete" if self.finish == "length" else "completed"
        output = [self._item("completed", text)]
        response = self.response(model, status, self._usage(usage), output)
        if self.request.get("store", True):
            self.store.put(self.id, Stored(self.messages, response))
        return response

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        data = {**data, "sequence_number": self.seq, "type": name}
        self.seq += 1
        return _event(name, data)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            self.status = message["status"]
            self.stream = any(
                k == b"content-type" and v.startswith(SSE) for k, v in message.get("headers", ())
            )
            if self.stream:
                await self.send(message)
                model = self.request.get("model") or ""
                opening = self.response(model, "in_progress", None, [])
                head = self._event("response.created", {"response": opening}) + self._event(
                    "response.in_progress", {"response": opening}
                )
                await self.send({"type": "http.response.body", "body": head, "more_body": True})
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream:
            out = b"".join(self._events(c) for c in _chat_events(body))
            await self.send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._body += body
        if more:
            return
        if self.status == 200:
            chat = orjson.loads(self._body)
            choice = chat["choices"][0]
            self.finish = choice["finish_reason"]
            text = choice["message"].get("content") or ""
            out = orjson.dumps(self._done(chat["model"], chat.get("usage"), text))
        else:
            out = self._body
        assert self.start is not None
        await self.send(_with_length(self.start, len(out)))
        await self.send({"type": "http.response.body", "body": out})

    def _events(self, chunk: dict[str, Any] | None) -> bytes:
        if chunk is None:
            return b""
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: the stream's end
            text = "".join(self.text)
            out = b""
            if self.opened:
                out += self._event(
                    "response.output_text.done",
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "logprobs": [],
                        "output_index": 0,
                        "text": text,
                    },
                )
                out += self._event(
                    "response.content_part.done",
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "output_index": 0,
                        "part": self._part(text),
                    },
                )
                out += self._event(
                    "response.output_item.done",
                    {"item": self._item("completed", text), "output_index": 0},
                )
            final = self._done(chunk["model"], chunk.get("usage"), text)
            return out + self._event("response.completed", {"response": final})
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        delta = (choice.get("delta") or {}).get("content")
        if not delta:
            return b""
        out = b""
        if not self.opened:
            self.opened = True
            out += self._event(
                "response.output_item.added",
                {"item": self._item("in_progress", None), "output_index": 0},
            )
            out += self._event(
                "response.content_part.added",
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": 0,
                    "part": self._part("", []),
                },
            )
        self.text.append(delta)
        return out + self._event(
            "response.output_text.delta",
            {
                "content_index": 0,
                "delta": delta,
                "item_id": self.item_id,
                "logprobs": [],
                "output_index": 0,
            },
        )
