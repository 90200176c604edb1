"""Reading a completion or chat request: only the fields a real engine looks at, checked once.

The body is parsed once with orjson and no per-request model is built, so parsing stays
off a benchmark's critical path. Refusals are ``ClientError``s (OpenAI error shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from switchyard.mock.asgi import ClientError
from switchyard.mock.engine.api import context_length_error
from switchyard.mock.epd import count_images, image_refs, mm_hash
from switchyard.mock.lora import Adapter
from switchyard.mock.tokenizer import ModelTokenizer, TemplateError


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
    lora: Adapter | None = None  # the adapter the request names as its model


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request is checked against: the served model, its adapters (the live
    registry) and its context window."""

    model: str
    default_max_tokens: int
    max_len: int
    adapters: Mapping[str, Adapter] = field(default_factory=dict)


def parse_request(data: dict[str, Any], chat: bool, tok: ModelTokenizer, limits: Limits) -> Parsed:
    model = data.get("model")
    lora = None
    if model is not None and model != limits.model:
        lora = limits.adapters.get(model) if isinstance(model, str) else None
        if lora is None:
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
            prompt_ids = tok.tokenize_chat(messages)
        except TemplateError as exc:
            raise ClientError(400, str(exc), "messages") from exc
        num_images = count_images(messages)
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt_ids = tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            raise ClientError(
                400, "prompt must be a non-empty string or token list (one prompt)", "prompt"
            )
        max_tokens = data.get("max_tokens")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ClientError(400, "max_tokens must be a positive integer", "max_tokens")
    too_long = context_length_error(limits.max_len, len(prompt_ids), max_tokens)
    if too_long is not None:
        raise ClientError(400, too_long)
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
        lora=lora,
    )
