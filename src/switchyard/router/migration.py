"""Mid-stream migration: a stream whose worker fails after its first byte resumes on another
worker, and its client sees one stream.

A streamed completion or chat that may migrate asks its worker for token ids
(``return_token_ids``, vLLM's), and the ids are nulled in each chunk before the client sees
it, unless the client asked for them: the client gets the bytes it would have had without
the flag. The relay keeps the chunks as they came, a list append up to ``max_kept_bytes``,
and parses them only when the stream fails: no per-chunk parse, measurable on the SSE
path. A failure is a cut connection, an engine's error event, or a stall: no chunk for
``stall_factor`` times the worker's learned gap between chunks (at least
``stall_floor_s``).

Both routes continue on ``/v1/completions`` from a token-id prompt: the prompt's ids (the
rendered chat, for a chat) and the ids generated so far, with ``max_tokens`` less what was
generated. A chat's continuation chunks are rewritten as ``chat.completion.chunk`` events
under the original id, model and creation time. Token ids continue a chat exactly: a chat
continued from its text (``continue_final_message``) is re-tokenized by the engine, and
the ids at the boundary can differ from those generated, so the rest of the answer can.

Not migrated (the stream ends with an error event, as without migration): structured
output, tool calls, ``n`` or ``best_of`` above one, log probabilities, ``echo``, stop
strings (the engine holds back text that may begin one, and a stop string can straddle
the boundary), frequency and presence penalties (they count only generated tokens),
continuous usage statistics, an answer with reasoning or tool-call deltas, an engine that
returns no token ids, and a stream longer than ``max_kept_bytes``.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from switchyard.router.relay import EngineErrorEvent, UpstreamTimeout
from switchyard.router.request import CHAT, COMPLETIONS, RoutedRequest
from switchyard.router.settings import Migration as MigrationSettings
from switchyard.router.usage import Usage

CUT, ERROR_EVENT, STALL = "cut", "error_event", "stall"
RESUMED, FAILED, NOT_ALLOWED = "resumed", "failed", "not_allowed"

_EVENT_END = b"\n\n"
_DONE = b"data: [DONE]\n\n"
_ERROR = b'data: {"error"'
_LAST = (b"}}\n\n", b"[DONE]\n\n")  # how an error event, or the [DONE] after it, ends
_IDS = re.compile(rb'token_ids":\[[0-9, ]*\]')  # and prompt_token_ids
_IDS_MARK = b'token_ids":['
# A stream with no event end in this many bytes is not SSE as engines send it: relayed as
# it comes, not kept.
_MAX_CARRY_BYTES = 256 * 1024
# The learned gap between chunks: weight of each stream's mean gap.
_GAP_WEIGHT = 0.2

# Request fields that make a continuation inexact or impossible, and when they do.
_FORBIDDEN_ANY = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
    "grammar",
    "regex",
    "json_schema",
    "tools",
    "functions",
    "prompt_logprobs",
    "suffix",
)
# A completion's fields the continuation sets itself; the rest go on as they were.
_COMPLETION_SET = frozenset(
    {"prompt", "max_tokens", "stream", "stream_options", "return_token_ids", "min_tokens"}
)
# A chat's fields that mean the same on /v1/completions (sampling, priority, caching).
_CHAT_CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "cache_salt",
    "user",
    "vllm_xargs",
)


def not_resumable(req: RoutedRequest) -> str | None:
    """Why ``req``'s stream cannot continue exactly on another worker; None if it can."""
    data = req.data
    for key in _FORBIDDEN_ANY:
        if data.get(key):
            return key
    if data.get("n", 1) != 1 or data.get("best_of") not in (None, 1):
        return "n"
    if data.get("use_beam_search") or data.get("echo"):
        return "echo"
    if data.get("logprobs") or data.get("top_logprobs"):
        return "logprobs"
    if data.get("stop"):
        return "stop"
    if data.get("frequency_penalty") or data.get("presence_penalty"):
        return "penalty"
    options = data.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or options.get("continuous_usage_stats")
    ):
        return "stream_options"
    if req.route == COMPLETIONS:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and not (
            len(prompt) == 1 and isinstance(prompt[0], str) or _ids(prompt)
        ):
            return "prompts"
    return None


def _ids(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(t) is int for t in value)


@dataclass(frozen=True, slots=True)
class Plan:
    """How a stream that may migrate is asked for: ``body`` (with ``return_token_ids``),
    and whether the ids are nulled before the client sees them (``strip``)."""

    body: bytes
    strip: bool


class Migrator:
    """The migration settings, and each worker's learned gap between stream chunks."""

    def __init__(self, settings: MigrationSettings, idle_s: float) -> None:
        self.settings = settings
        self.idle_s = idle_s
        self.max_per_request = settings.max_per_request
        self._gap: dict[str, float] = {}
        self._fleet_gap: float | None = None

    def plan(self, req: RoutedRequest) -> Plan | None:
        """The plan of a streamed completion or chat that may migrate; None otherwise."""
        if req.route != COMPLETIONS and req.route != CHAT:
            return None
        if not self.settings.enabled or not_resumable(req) is not None:
            return None
        if req.data.get("return_token_ids") is True:
            return Plan(req.body, False)
        body = req.body
        end = body.rfind(b"}")
        # ``parse`` read it as a JSON object: its last brace closes it; a later duplicate
        # key wins in vLLM's parser, so a client's ``false`` is overridden here
        return Plan(body[:end] + b',"return_token_ids":true}', True)

    def keeper(self, plan: Plan, req: RoutedRequest) -> Keeper:
        return Keeper(plan.strip, req.route == CHAT, self.settings.max_kept_bytes)

    def stall_s(self, worker_id: str) -> float:
        """How long a stream from ``worker_id`` may go without a chunk before it migrates."""
        gap = self._gap.get(worker_id, self._fleet_gap)
        wait = self.settings.stall_floor_s
        if gap is not None and gap * self.settings.stall_factor > wait:
            wait = gap * self.settings.stall_factor
        return wait if wait < self.idle_s else self.idle_s

    def learn(self, worker_id: str, gap_s: float) -> None:
        """A stream from ``worker_id`` came with ``gap_s`` between chunks on average."""
        if gap_s <= 0:
            return
        old = self._gap.get(worker_id)
        self._gap[worker_id] = gap_s if old is None else old + _GAP_WEIGHT * (gap_s - old)
        fleet = self._fleet_gap
        self._fleet_gap = gap_s if fleet is None else fleet + _GAP_WEIGHT * (gap_s - fleet)


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, EngineErrorEvent):
        return ERROR_EVENT
    if isinstance(exc, UpstreamTimeout | TimeoutError):
        return STALL
    return CUT


class Transcript:
    """What the client was sent of one stream, parsed: its envelope, the prompt's and the
    generated token ids, and how far it got."""

    __slots__ = (
        "id",
        "created",
        "model",
        "prompt",
        "generated",
        "finish",
        "stop_reason",
        "usage_sent",
        "done",
        "problem",
        "usage",
    )

    def __init__(self) -> None:
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.prompt: list[int] | None = None
        self.generated = array("q")
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.usage_sent = False
        self.done = False
        self.problem: str | None = None
        self.usage: dict[str, Any] | None = None  # the last continuation's

    def absorb(self, events: bytes) -> None:
        """Complete SSE events, as the worker sent them."""
        for event in events.split(_EVENT_END):
            data = _data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                self.problem = "unreadable"
                continue
            self.take(obj)

    def take(self, obj: Any) -> list[dict[str, Any]]:
        """One parsed chunk; returns its choices."""
        if not isinstance(obj, dict):
            self.problem = "unreadable"
            return []
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        prompt = obj.get("prompt_token_ids")  # a chat's, on its first chunk
        if prompt is not None and self.prompt is None:
            self.prompt = prompt if _ids(prompt) else None
        choices = obj.get("choices")
        if not isinstance(choices, list):
            self.problem = "unreadable"
            return []
        if not choices and obj.get("usage") is not None:
            self.usage_sent = True
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.problem = "choices"
                continue
            prompt = choice.get("prompt_token_ids")  # a completion's, on its first chunk
            if prompt is not None and self.prompt is None:
                self.prompt = prompt if _ids(prompt) else None
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if (
                    delta.get("tool_calls")
                    or delta.get("reasoning_content")
                    or delta.get("reasoning")
                ):
                    self.problem = "delta"
                text = delta.get("content")
            else:
                text = choice.get("text")
            ids = choice.get("token_ids")
            if _ids(ids):
                self.generated.extend(ids)
            elif text:
                self.problem = "no_token_ids"
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finish = finish
                self.stop_reason = choice.get("stop_reason")
        return choices


def _null_ids(piece: bytes) -> bytes:
    """``piece`` with each token id list (``token_ids``, ``prompt_token_ids``) as null."""
    return _IDS.sub(b'token_ids":null', piece)


def _data(event: bytes) -> bytes | None:
    """The data of one SSE event (its ``data:`` lines joined), None if it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:].strip()
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class Keeper:
    """One stream's kept copy, and what its client is sent of each upstream piece."""

    __slots__ = (
        "strip",
        "chat",
        "max_bytes",
        "kept",
        "size",
        "carry",
        "error",
        "reads",
        "transcript",
        "passing",
        "previous",
        "last",
        "on_full",
    )

    def __init__(self, strip: bool, chat: bool, max_bytes: int) -> None:
        self.strip = strip
        self.chat = chat
        self.max_bytes = max_bytes
        self.kept: list[bytes] = []
        self.size = 0
        self.carry = b""  # an event's beginning, sent with its end
        self.error: bytes | None = None  # the engine's error event, and what came with it
        self.reads = 0
        self.transcript = Transcript()
        # relayed as it comes, not kept: no token ids, or not SSE as engines send it
        self.passing = False
        self.previous = self.last = b""  # the last two pieces sent (where usage is)
        # told once the stream is past ``max_bytes``: it can no longer migrate
        self.on_full: Callable[[], None] | None = None

    def feed(self, piece: bytes, first: bool = False) -> bytes:
        """What the client is sent of ``piece``: its complete events, token ids nulled
        where the client did not ask for them. An engine's error event (after the first
        piece) ends the stream here: it and what follows go to ``error``."""
        self.reads += 1
        if self.carry or self.error is not None or self.passing or not piece.endswith(_EVENT_END):
            if self.passing:
                return piece
            piece = self._whole(piece)
            if not piece:
                return piece
        if first and _IDS_MARK not in piece:
            # the engine ignored return_token_ids (SGLang, an older vLLM): nothing to resume
            # from, so the stream is relayed as it comes
            self.passing = True
            self.transcript.problem = "no_token_ids"
            piece, self.carry = piece + self.carry, b""
            return piece
        # an error event ends its stream: the piece ends with it or with the [DONE] after it
        if not first and piece.endswith(_LAST) and _ERROR in piece:
            at = piece.find(_ERROR)
            if at == 0 or piece[at - 1 : at] == b"\n":
                self.error, piece = piece[at:], piece[:at]
        if self.size < self.max_bytes:
            self.kept.append(piece)
        else:  # past the cap: only the last two, where usage is
            if not self.last and self.on_full is not None:
                self.on_full()
            self.previous, self.last = self.last, piece
        self.size += len(piece)
        return _null_ids(piece) if self.strip else piece

    def _whole(self, piece: bytes) -> bytes:
        """The complete events of ``piece`` and what was carried before it; the rest of it
        is carried to the next."""
        if self.error is not None:
            return b""
        if self.carry:
            piece = self.carry + piece
            self.carry = b""
        if not piece.endswith(_EVENT_END):
            end = piece.rfind(_EVENT_END) + 2
            if end == 1:  # no event ends in it
                end = 0
            self.carry = piece[end:]
            piece = piece[:end]
            if len(self.carry) > _MAX_CARRY_BYTES:
                self.passing = True
                self.transcript.problem = "not_sse"
                piece, self.carry = piece + self.carry, b""
        return piece

    def flush(self) -> bytes:
        """An unfinished event left at the stream's end, sent as it is."""
        rest, self.carry = self.carry, b""
        return rest

    def compact(self) -> Transcript:
        """The kept pieces parsed into the transcript."""
        if self.size > self.max_bytes:
            self.transcript.problem = "max_kept_bytes"
        if self.kept:
            self.transcript.absorb(b"".join(self.kept))
            self.kept.clear()
        return self.transcript

    def why_not(self) -> str | None:
        """Why the stream cannot resume from what was kept; None if it can."""
        t = self.compact()
        if t.problem is None and t.prompt is None:
            t.problem = "no_token_ids"
        return t.problem

    def generated(self) -> int:
        return len(self.transcript.generated)

    def continuation(self, req: RoutedRequest) -> bytes | None:
        """The body that continues the stream on ``/v1/completions``; None where nothing is
        left to generate (its finish was sent, or ``max_tokens`` reached)."""
        t = self.transcript
        data = req.data
        self.carry = b""  # an event the client never got a whole of
        if t.finish is not None:
            return None
        generated = len(t.generated)
        if self.chat:
            limit = data.get("max_completion_tokens", data.get("max_tokens"))
            body = {key: data[key] for key in _CHAT_CARRIED if key in data}
        else:
            limit = data.get("max_tokens", 16)
            body = {k: v for k, v in data.items() if k not in _COMPLETION_SET}
        left = None if limit is None else limit - generated
        if left is not None and left <= 0:
            return None
        min_tokens = data.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > generated:
            body["min_tokens"] = min_tokens - generated
        assert t.prompt is not None
        body.update(
            model=data["model"],
            prompt=[*t.prompt, *t.generated],
            max_tokens=left,  # null: the rest of the context, as a chat without it has
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
        )
        return orjson.dumps(body)

    def carried(self) -> int:
        """Tokens a continuation carries."""
        t = self.transcript
        return len(t.prompt or ()) + len(t.generated)

    # -- the continuation --------------------------------------------------------------

    def translate(self, piece: bytes, asked_usage: bool) -> tuple[bytes, bool]:
        """What the client is sent of a continuation's ``piece``, as the original stream's
        events; and whether an error event from the engine ended it."""
        if self.carry:
            piece = self.carry + piece
            self.carry = b""
        end = piece.rfind(_EVENT_END) + 2
        if end < len(piece):
            if end == 1:
                end = 0
            self.carry = piece[end:]
            piece = piece[:end]
        out: list[bytes] = []
        t = self.transcript
        for event in piece.split(_EVENT_END):
            data = _data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                out.append(self.ending(asked_usage))
                continue
            if data.startswith(b'{"error"'):
                self.error = event + _EVENT_END
                return b"".join(out), True
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return b"".join(out), True
            choices = t.take(obj)
            if not choices:
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    t.usage = usage
                    t.usage_sent = False  # the original's was never sent
                continue
            out.append(b"data: " + orjson.dumps(self._rewrite(obj, choices[0])) + _EVENT_END)
        return b"".join(out), False

    def _rewrite(self, obj: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        t = self.transcript
        ids = None if self.strip else choice.get("token_ids")
        if not self.chat:
            choice["prompt_token_ids"] = None
            choice["token_ids"] = ids
            obj.update(id=t.id, created=t.created, model=t.model)
            return obj
        finish = choice.get("finish_reason")
        out: dict[str, Any] = {
            "index": 0,
            "delta": {"content": choice.get("text") or ""},
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            out["stop_reason"] = choice.get("stop_reason")
        out["token_ids"] = ids
        return {
            "id": t.id,
            "object": "chat.completion.chunk",
            "created": t.created,
            "model": t.model,
            "choices": [out],
        }

    def ending(self, asked_usage: bool) -> bytes:
        """The stream's end: a finish where none was sent (``max_tokens`` reached), usage
        where the client asked for it, and ``[DONE]``."""
        t = self.transcript
        if t.done:
            return b""
        out = b""
        if t.finish is None:
            t.finish = "length"
            piece: dict[str, Any] = {"delta": {"content": ""}} if self.chat else {"text": ""}
            finish = {
                "index": 0,
                **piece,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            out += self._event(choices=[finish])
        if asked_usage and not t.usage_sent:
            out += self._event(choices=[], usage=self.usage_body())
            t.usage_sent = True
        t.done = True
        return out + _DONE

    def _event(self, **fields: Any) -> bytes:
        t = self.transcript
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        obj = {"id": t.id, "object": kind, "created": t.created, "model": t.model, **fields}
        return b"data: " + orjson.dumps(obj) + _EVENT_END

    def usage_body(self) -> dict[str, Any]:
        """The client's usage: the original prompt and every generated token, on both
        workers; cached tokens as the last worker found them, within the prompt."""
        t = self.transcript
        prompt = len(t.prompt or ())
        output = len(t.generated)
        usage = dict(t.usage or {})
        usage.update(prompt_tokens=prompt, total_tokens=prompt + output, completion_tokens=output)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            usage["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return usage

    def usage(self) -> Usage:
        t = self.transcript
        details = self.usage_body().get("prompt_tokens_details")
        cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
        return Usage(len(t.prompt or ()), len(t.generated), cached or 0)

    def tail(self) -> bytes:
        """The last two pieces sent, where usage is."""
        if self.size <= self.max_bytes:
            return b"".join(self.kept[-2:])
        return self.previous + self.last
