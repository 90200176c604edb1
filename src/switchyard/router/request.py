"""What routing needs from a request body, read once with orjson and never re-validated.

The engine validates the full request; the router only checks the few fields it
must understand to route, so a bad request still gets a clear 400 before it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from switchyard.kvstore.tokenize import CHARS_PER_TOKEN
from switchyard.router.errors import RouterError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
DATA_ROUTES = (COMPLETIONS, CHAT, EMBEDDINGS)
# Body fields that steer an engine's KV transfer (where to pull or push the cache): only the
# router's P/D orchestrator writes them. A client's would make an engine connect where the
# client says, so they are refused unless the router sits behind a P/D proxy that sets them.
TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(slots=True)
class RoutedRequest:
    route: str
    body: bytes
    data: dict[str, Any]
    model: str
    stream: bool
    session_key: str | None
    prompt_chars: int

    @property
    def prompt_tokens_estimate(self) -> int:
        return self.prompt_chars // CHARS_PER_TOKEN + 1

    @property
    def turn(self) -> str:
        """'first' for a chat with no assistant message, 'later' for one with earlier
        answers, 'prompt' for a completion or an embedding (``parse`` checked the shape)."""
        if self.route != CHAT:
            return "prompt"
        messages = self.data["messages"]
        return "later" if any(m["role"] == "assistant" for m in messages) else "first"


def parse(
    route: str, body: bytes, session_header: str | None, transfer_fields: bool = False
) -> RoutedRequest:
    """The routing fields of ``body``; ``transfer_fields``: accept ``TRANSFER_FIELDS``."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RouterError(400, "Request body must be a JSON object")
    model = data.get("model")
    if model is None:
        raise RouterError(400, "Missing required parameter: 'model'", param="model")
    if not isinstance(model, str) or not model:
        raise RouterError(400, "'model' must be a non-empty string", param="model")
    if not transfer_fields:
        for field in TRANSFER_FIELDS:
            if field in data:
                raise RouterError(
                    400,
                    f"'{field}' is set by the router, not by clients",
                    param=field,
                    code="routing_field_not_allowed",
                )
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise RouterError(400, "'stream' must be a boolean", param="stream")
    if route == CHAT:
        prompt_chars = _messages_chars(data.get("messages"))
    elif route == COMPLETIONS:
        prompt_chars = _prompt_chars(data.get("prompt"), "prompt")
    else:
        prompt_chars = _prompt_chars(data.get("input"), "input")
    user = data.get("user")
    session_key = session_header or (user if isinstance(user, str) and user else None)
    return RoutedRequest(route, body, data, model, stream, session_key, prompt_chars)


def _prompt_chars(prompt: Any, param: str) -> int:
    if prompt is None:
        raise RouterError(400, f"Missing required parameter: '{param}'", param=param)
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt)
        if isinstance(first, int) and all(isinstance(t, int) for t in prompt):
            return len(prompt) * CHARS_PER_TOKEN
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt) * CHARS_PER_TOKEN
    raise RouterError(
        400,
        f"'{param}' must be a string, a list of strings, or token ids",
        param=param,
    )


def _messages_chars(messages: Any) -> int:
    if messages is None:
        raise RouterError(400, "Missing required parameter: 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RouterError(400, "'messages' must be a non-empty list", param="messages")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RouterError(
                400, f"messages[{i}] must be an object with a string 'role'", param="messages"
            )
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                total += _part_chars(part, i, j)
        elif content is not None:
            raise RouterError(
                400, f"messages[{i}].content must be a string or a list of parts", param="messages"
            )
    return total


def _part_chars(part: Any, i: int, j: int) -> int:
    """A content part is an object with a string ``type``; a text part's ``text`` is a string."""
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise RouterError(400, f"{where} must be an object with a string 'type'", param="messages")
    text = part.get("text")
    if text is None and part["type"] != "text":
        return 0
    if not isinstance(text, str):
        raise RouterError(400, f"{where}.text must be a string", param="messages")
    return len(text)
