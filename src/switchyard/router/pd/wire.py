"""The request bodies of each leg, field for field as the engines' own proxies send them.

vLLM (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` and
``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py``):

- prefill leg: the client's body with ``kv_transfer_params`` = ``{do_remote_decode: true,
  do_remote_prefill: false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}``,
  ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when present),
  ``stream_options`` removed;
- decode leg: the client's body plus the ``kv_transfer_params`` the prefill answered with;
- encode leg (E/P/D): the chat body with ``max_tokens: 1``, ``stream: false``, no
  ``stream_options``, sent to an encoder's ``/v1/chat/completions``. Real vLLM moves the
  embeddings through its EC connector keyed by the image hash, so its answer carries no
  handle; when an encoder does answer ``ec_transfer_params`` (the mock does: image hash →
  ``{num_encoder_tokens, encoder_engine_id, encoder_host, encoder_port}``) it is added
  unchanged to the prefill and decode bodies.

SGLang (``sglang/srt/disaggregation/mini_lb.py``): the client's body to both legs plus
``bootstrap_host`` (the prefill's host, IPv6 in brackets), ``bootstrap_port`` (the prefill's
bootstrap server) and ``bootstrap_room`` (random in [0, 2**63)); for a batch each of the
three is a list with one entry per item.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import orjson

VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})

_rooms = random.SystemRandom()


def one_token(data: dict[str, Any]) -> dict[str, Any]:
    """The body asking for a single non-streamed token (the prefill and encode legs)."""
    out = {k: v for k, v in data.items() if k != "stream_options"}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def vllm_prefill(data: dict[str, Any]) -> bytes:
    body = one_token(data)
    body["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    return orjson.dumps(body)


def vllm_decode(data: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    return orjson.dumps({**data, "kv_transfer_params": kv_transfer_params})


def bootstrap_host(url: str) -> str:
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def batch_size(data: dict[str, Any]) -> int | None:
    """Items in a completions batch (prompt list of strings / of token lists), else None."""
    for key in ("prompt", "text", "input_ids"):
        items = data.get(key)
        if isinstance(items, list) and len(items) > 1 and not isinstance(items[0], int):
            return len(items)
    return None


def new_room() -> int:
    return _rooms.randrange(0, 2**63)


def sglang_bootstrap(data: dict[str, Any], host: str, port: int) -> bytes:
    n = batch_size(data)
    if n is None:
        extra: dict[str, Any] = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": new_room(),
        }
    else:
        extra = {
            "bootstrap_host": [host] * n,
            "bootstrap_port": [port] * n,
            "bootstrap_room": [new_room() for _ in range(n)],
        }
    return orjson.dumps({**data, **extra})


def image_refs(data: dict[str, Any]) -> list[str]:
    """The image URLs of a chat body, in order (empty for text-only requests)."""
    refs: list[str] = []
    messages = data.get("messages")
    if not isinstance(messages, list):
        return refs
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
