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
MESSAGES = "/v1/messages"  # Anthropic Messages
COUNT_TOKENS = "/v1/messages/count_tokens"  # Anthropic's, served by vLLM
# The routes whose clients speak Anthropic's API: its key header and its error shape.
ANTHROPIC_ROUTES = frozenset({MESSAGES, COUNT_TOKENS})
RESPONSES = "/v1/responses"  # OpenAI Responses
RERANK = "/v1/rerank"
SCORE = "/v1/score"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
# Relayed as they are, to a worker of their model chosen by load (no prompt to match).
PASS_THROUGH = (RERANK, SCORE, TOKENIZE, DETOKENIZE, COUNT_TOKENS)
# The routes beside the three OpenAI ones: each request goes through ``app.RouterApp``'s
# adapter (its error shape, what its answer tells), which the three never pay for.
API_ROUTES = (MESSAGES, RESPONSES, *PASS_THROUGH)
# Routes whose body may leave out ``model`` (vLLM's own): the fleet's one model serves them.
MODEL_OPTIONAL = frozenset({TOKENIZE, DETOKENIZE})
# Body fields that steer an engine's KV transfer (where to pull or push the cache): only the
# router's P/D orchestrator writes them. A client's would make an engine connect where the
# client says, so they are refused unless the router sits behind a P/D proxy that sets them.
TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


class TokenRatio:
    """Characters per prompt token, learnt from the prompts whose tokens the router or the
    engine counted: flow control weighs a waiting prompt against the tokens a worker has
    queued, so its estimate must be in the same tokens, and a fleet's traffic (code, other
    languages) can be twice as dense as prose's four characters a token."""

    __slots__ = ("value",)

    WEIGHT = 0.05  # of each new observation: about the last twenty prompts
    BOUNDS = (1.0, 16.0)  # a ratio outside them is a bad count, not a language

    def __init__(self, initial: float = CHARS_PER_TOKEN) -> None:
        self.value = float(initial)

    def observe(self, chars: int, tokens: int) -> None:
        """``chars`` of a prompt were ``tokens`` tokens."""
        if chars <= 0 or tokens <= 0:
            return
        low, high = self.BOUNDS
        ratio = chars / tokens  # clamped by comparisons: min and max cost several times more
        ratio = low if ratio < low else high if ratio > high else ratio
        self.value += self.WEIGHT * (ratio - self.value)


@dataclass(slots=True)
class RoutedRequest:
    route: str
    body: bytes
    data: dict[str, Any]
    model: str
    stream: bool
    session_key: str | None
    prompt_chars: int
    # The chat a Messages or Responses request becomes at the engine, for prefix matching
    # (None: the route has none, or the router cannot render it).
    messages: list[dict[str, Any]] | None = None
    chars_per_token: float = CHARS_PER_TOKEN  # the app sets its learnt ``TokenRatio``

    @property
    def prompt_tokens_estimate(self) -> int:
        return int(self.prompt_chars / self.chars_per_token) + 1

    @property
    def turn(self) -> str:
        """'first' for a chat with no assistant message, 'later' for one with earlier
        answers, 'prompt' for a completion or an embedding (``parse`` checked the shape)."""
        if self.route != CHAT:
            if self.route in (MESSAGES, RESPONSES):
                return _api_turn(self)
            return "prompt"
        messages = self.data["messages"]
        return "later" if any(m["role"] == "assistant" for m in messages) else "first"


def _api_turn(req: RoutedRequest) -> str:
    if req.data.get("previous_response_id") is not None:
        return "later"
    messages = req.messages or ()
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
    if model is None and route in MODEL_OPTIONAL:
        model = ""  # the app names the fleet's one model
    elif model is None:
        raise RouterError(400, "Missing required parameter: 'model'", param="model")
    if not isinstance(model, str) or not (model or route in MODEL_OPTIONAL):
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
    messages = None
    if route == CHAT:
        prompt_chars = _messages_chars(data.get("messages"))
    elif route == COMPLETIONS:
        prompt_chars = _prompt_chars(data.get("prompt"), "prompt")
    elif route == EMBEDDINGS:
        prompt_chars = _prompt_chars(data.get("input"), "input")
    elif route == MESSAGES:
        messages = anthropic_chat(data)
        prompt_chars = _rendered_chars(messages)
    elif route == RESPONSES:
        messages = responses_chat(data)
        prompt_chars = len(body) if messages is None else _rendered_chars(messages)
    else:
        prompt_chars = len(body)  # rerank, score, (de)tokenize: the body is the load
    user = data.get("user")
    session_key = session_header or (user if isinstance(user, str) and user else None)
    return RoutedRequest(route, body, data, model, stream, session_key, prompt_chars, messages)


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


def _rendered_chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content)
    return total


def _text_of(blocks: Any, where: str, param: str) -> str:
    """The text of an Anthropic system field or message content: a string or text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RouterError(400, f"{where} must be a string or a list of blocks", param=param)
    parts: list[str] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RouterError(
                400, f"{where}[{j}] must be an object with a string 'type'", param=param
            )
        text = block.get("text")
        if block["type"] == "text" and isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts)


def anthropic_chat(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM turns an Anthropic Messages request into, as far as routing
    reads them: ``system`` (a string or text blocks, joined) leads as a system message,
    a single text block becomes a string, several stay text parts. Tool and image blocks
    are left out: those prompts match the engine's only up to their first such block."""
    raw = data.get("messages")
    if raw is None:
        raise RouterError(400, "Missing required parameter: 'messages'", param="messages")
    if not isinstance(raw, list) or not raw:
        raise RouterError(400, "'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        text = _text_of(system, "system", "system")
        if text and not text.startswith("x-anthropic-billing-header"):
            out.append({"role": "system", "content": text})
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in _ANTHROPIC_ROLES:
            raise RouterError(
                400,
                f"messages[{i}] must be an object with role 'user' or 'assistant'",
                param="messages",
            )
        content = message.get("content")
        where = f"messages[{i}].content"
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RouterError(
                400, f"{where} must be a string or a list of blocks", param="messages"
            )
        _text_of(content, where, "messages")  # checks the blocks' shape
        texts = [b["text"] for b in content if b["type"] == "text" and b.get("text")]
        if message["role"] == "system":
            if texts:
                out.append({"role": "system", "content": "".join(texts)})
        elif len(texts) == 1 and len(content) == 1:
            out.append({"role": message["role"], "content": texts[0]})
        elif texts:
            parts = [{"type": "text", "text": t} for t in texts]
            out.append({"role": message["role"], "content": parts})
    return out


_ANTHROPIC_ROLES = frozenset({"user", "assistant", "system"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def responses_chat(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM renders a Responses request as: ``instructions`` as the
    system message, then ``input`` (a string is one user message; items with a role are
    messages, an assistant's first text part its content). None where the prompt begins
    with what only the engine holds (``previous_response_id``) or with items the router
    does not render (tool calls, reasoning)."""
    raw = data.get("input")
    if raw is None:
        raise RouterError(400, "Missing required parameter: 'input'", param="input")
    if not isinstance(raw, str | list):
        raise RouterError(400, "'input' must be a string or a list of items", param="input")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RouterError(400, "'instructions' must be a string", param="instructions")
    previous = data.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RouterError(
            400, "'previous_response_id' must be a string", param="previous_response_id"
        )
    if previous is not None:
        return None
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        out.append({"role": "user", "content": raw})
        return out
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            return None
        if item.get("type", "message") != "message":
            return None
        content = item.get("content")
        if isinstance(content, str):
            out.append({"role": item["role"], "content": content})
            continue
        if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content
        ):
            return None
        texts = [p.get("text") for p in content]
        if not all(isinstance(t, str) for t in texts):
            return None
        if item["role"] == "assistant":
            out.append({"role": "assistant", "content": texts[0] if texts else ""})
        else:
            parts = [{"type": "text", "text": t} for t in texts]
            out.append({"role": item["role"], "content": parts})
    return out
