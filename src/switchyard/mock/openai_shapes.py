"""OpenAI response bodies and SSE chunks in the shapes vLLM sends them.

Shapes follow vLLM 0.10's ``CompletionResponse`` / ``ChatCompletionResponse`` (non-stream,
all fields dumped), ``CompletionStreamResponse`` (dumped with ``exclude_unset=False``)
and ``ChatCompletionStreamResponse`` (dumped with ``exclude_unset=True``: the first chunk
carries ``delta.role``, the last carries ``finish_reason`` and ``stop_reason``), the
final usage chunk with empty ``choices`` and ``data: [DONE]``. The goldens in
``tests/fixtures/openai`` pin them.

Stream chunks are pre-encoded per request: the constant prefix and suffix of every
chunk is built once, so each chunk costs one ``bytes.join``.
"""

from __future__ import annotations

from typing import Any

import orjson

from switchyard.mock.tokenizer import FILLER_WORD

DONE = b"data: [DONE]\n\n"
_FILLER = FILLER_WORD.encode()
_FILLER_CACHE: list[bytes] = [_FILLER * n for n in range(65)]

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLarge",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def filler(n: int) -> bytes:
    """The text of ``n`` generated tokens (one filler word per token)."""
    return _FILLER_CACHE[n] if n < len(_FILLER_CACHE) else _FILLER * n


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse``: ``{"error": {message, type, param, code}}``."""
    kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    return orjson.dumps(
        {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": use,
            "kv_transfer_params": kv_transfer_params,
        }
    )


def chat_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    return orjson.dumps(
        {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": use,
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }
    )


class StreamEncoder:
    """Pre-encoded SSE chunks of one streamed completion or chat completion."""

    __slots__ = ("_head", "_mid", "_chat", "_id", "_created", "_model")

    def __init__(self, chat: bool, rid: str, created: int, model: str) -> None:
        self._chat = chat
        self._id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
        self._created = created
        self._model = model
        envelope = orjson.dumps(
            {
                "id": self._id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
            }
        )[:-1]
        if chat:
            self._head = b"data: " + envelope + b',"choices":[{"index":0,"delta":{"content":"'
            self._mid = b'"},"logprobs":null,"finish_reason":'
        else:
            self._head = b"data: " + envelope + b',"choices":[{"index":0,"text":"'
            self._mid = b'","logprobs":null,"finish_reason":'

    def first(self, use: dict[str, Any] | None = None) -> bytes:
        """Chat streams open with the assistant role and empty content (with continuous
        usage, zero completion tokens); completions do not."""
        if not self._chat:
            return b""
        tail = b',"usage":' + orjson.dumps(use) if use is not None else b""
        return b"".join(
            (
                self._head.replace(
                    b'"delta":{"content":"', b'"delta":{"role":"assistant","content":"'
                ),
                b'"},"logprobs":null,"finish_reason":null}]',
                tail,
                b"}\n\n",
            )
        )

    def chunk(
        self, n_tokens: int, finish_reason: str | None, use: dict[str, Any] | None = None
    ) -> bytes:
        """One chunk carrying ``n_tokens`` tokens of text; ``use`` adds continuous usage."""
        if finish_reason is None:
            tail = b"null}]" if self._chat else b'null,"stop_reason":null}]'
        else:
            tail = b'"' + finish_reason.encode() + b'","stop_reason":null}]'
        if use is not None:
            tail += b',"usage":' + orjson.dumps(use)
        elif not self._chat:
            tail += b',"usage":null'
        return b"".join((self._head, filler(n_tokens), self._mid, tail, b"}\n\n"))

    def usage_chunk(self, use: dict[str, Any]) -> bytes:
        body: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": use,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"
