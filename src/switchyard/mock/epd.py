"""The encode role of E/P/D: image hashing, the simulated vision encoder, ``ec_transfer_params``.

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
import os
import time
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from switchyard.mock import openai_shapes as shapes
from switchyard.mock.asgi import JSON, ClientError, guard, json_body, respond
from switchyard.mock.settings import MockSettings

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# What the mock encoder reports per image, as vLLM's ``num_encoder_tokens``.
ENCODER_TOKENS_PER_IMAGE = 256


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


class Encoder:
    """The simulated vision encoder of one mock engine (any role pays its delay)."""

    def __init__(self, settings: MockSettings, engine_id: str, port: int) -> None:
        self.s = settings
        self.engine_id = engine_id
        self.port = port

    def transfer_params(self, refs: list[str]) -> dict[str, Any]:
        """vLLM's ``ec_transfer_params``: one entry per image hash (``num_encoder_tokens``)."""
        return {
            mm_hash(ref): {
                "num_encoder_tokens": ENCODER_TOKENS_PER_IMAGE,
                "encoder_engine_id": self.engine_id,
                "encoder_host": self.s.host,
                "encoder_port": self.port,
            }
            for ref in refs
        }

    async def delay(self, num_images: int) -> None:
        if num_images:
            await asyncio.sleep(num_images * self.s.encode_us_per_image / 1e6 / self.s.speed)

    async def encode(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/encode`` ``{"messages"}`` or ``{"images": [url...]}``: simulated ViT."""

        async def work() -> tuple[int, bytes]:
            data = await json_body(receive)
            if isinstance(data.get("images"), list):
                refs = [str(u) for u in data["images"]]
            elif isinstance(data.get("messages"), list):
                refs = image_refs(data["messages"])
            else:
                raise ClientError(400, "messages or images is required", "messages")
            await self.delay(len(refs))
            body = {
                "id": f"enc-{os.urandom(16).hex()}",
                "object": "encode",
                "model": self.s.model,
                "num_images": len(refs),
                "ec_transfer_params": self.transfer_params(refs),
            }
            return 200, orjson.dumps(body)

        await guard(send, work)

    async def encode_chat(
        self, send: Send, rid: str, data: dict[str, Any], rid_header: tuple[bytes, bytes]
    ) -> None:
        """Encode role on the chat route (vLLM EPD proxy style): encode, answer no text."""
        refs = image_refs(data["messages"])
        await self.delay(len(refs))
        body = orjson.loads(
            shapes.chat_body(
                rid, int(time.time()), self.s.model, "", "length", shapes.usage(0, 0, 0), None
            )
        )
        body["ec_transfer_params"] = self.transfer_params(refs)
        await respond(send, 200, orjson.dumps(body), JSON, [rid_header])
