"""Tokenization for routing: the same token ids the engine will see, computed cheaply.

Three modes:
- a Hugging Face tokenizer directory (``tokenizer.json`` + the Jinja ``chat_template`` of
  ``tokenizer_config.json``), exact;
- an engine's ``/tokenize`` endpoint, exact, cached per distinct prompt; asked only from
  the event loop (``aencode_*``), through one kept pool of our own client: a blocking call
  there would stall every request the router has in flight for the engine's answer;
- an approximate character mode (no tokenizer at all): stable pseudo-tokens, one per
  ``CHARS_PER_TOKEN`` characters, good enough to see shared prefixes, marked ``exact=False``.

Repeated work is not redone. A chat's messages are rendered and tokenized one by one
and the ids of each message are cached under a hash of the message, so turn k+1 of a
conversation tokenizes only what turn k did not send. That is exact only when the
template renders each message on its own and every message starts with a special token
(which no token spans); both are checked at load time against a full render on sample
conversations, and chats fall back to one full render when they do not hold. Text
(completion prompts, and new messages) is cut at boundaries no token can cross (special
tokens, a lone newline between two non-space characters, a space before a word for
byte-level BPE), and the ids of each piece are cached, so prompts that share a long
prefix share its pieces; probes at load time check each cut rule for this tokenizer.
Both caches share one bound in bytes. Above them, per conversation, the ids of the chat so
far and their block keys are kept (``kvstore.conversation``): a turn that extends a chat
seen before is matched to it by comparing its messages, and only what it adds is looked up
in the message cache, rendered, tokenized and keyed.

A byte-level BPE tokenizer is run by tiktoken where it gives the same ids
(``kvstore.bpe``; several times faster). Long uncached text is tokenized in one worker
thread (tiktoken and HF ``tokenizers`` release the GIL), first in, first out: the event loop
stays free and requests are decided in the order they came.

Length (about 730 lines): the three modes, the two caches and their load-time checks must
agree on one cut of the text, so they stay together; the byte-bounded LRU and the chat
layout probe are the parts that could move out.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from switchyard.kvstore.bpe import Encoder, fast_encoder
from switchyard.kvstore.conversation import CONVERSATION_BYTES, ChatPrefix, ConversationCache, Line
from switchyard.kvstore.settings import TOKENIZE_CACHE_BYTES as CACHE_BYTES
from switchyard.net.httpclient import ConnectionPool

T = TypeVar("T")

# Characters per token when no tokenizer is at hand (also the router's token estimate).
CHARS_PER_TOKEN = 4
# Pieces shorter than this are merged with their neighbour before caching.
MIN_PIECE_CHARS = 256
# Text with more uncached characters than this is tokenized in the worker thread.
OFFLOAD_CHARS = 4096
# Each call to an engine's /tokenize as a whole, waiting for a connection included.
_ENGINE_TIMEOUT_S = 5.0
# Connections to the engine: the tokenizations of concurrent requests go in parallel.
_ENGINE_CONNECTIONS = 64
# Below uvicorn's 5 s keep-alive, so a connection is not reused just as the engine drops it.
_ENGINE_KEEPALIVE_S = 4.0
_JSON = {"content-type": "application/json"}
# What one cached token costs in memory (a list slot and an int object), and one entry.
_TOKEN_BYTES = 36
# What a message's role and delimiters add to its content, about (in characters).
_FRAME_CHARS = 16
_ENTRY_BYTES = 240
# A newline between two non-spaces; a space after a non-space and before a letter. Each
# pattern starts with its literal so ``re`` scans for it at memchr speed; led by the
# lookbehind it would try every position, an order of magnitude slower on a long message
# (docs/decisions/0006-bpe-fast-path.md).
_NEWLINE_CUT = re.compile(r"\n(?<=\S\n)(?=\S)")
_SPACE_CUT = re.compile(r" (?<=\S )(?=[^\W\d_])")
_PROBES = (
    "Hello world.\nSecond line, with words.\n\nThird paragraph: 42 apples\n  indented\nend",
    "def f(x):\n    return x + 1\n# comment\nclass A:\n    pass\n",
    "Ünïcödé text\nnext 🙂 line\n\tTabbed\nlast",
    "It's 3 o'clock, they'd said; don't   wait. (Really?) x-ray e.g. naïve café über",
    "a, b; c: d! e? «f» 'g' \"h\" [i] {j} 2nd 3rd word-word snake_case CamelCase",
)
# Conversations that show whether a template renders each message on its own.
_SAMPLE_CHATS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "Hi there."}],
    [
        {"role": "system", "content": "You are terse.\nAnswer in one line."},
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question, longer:\n  with lines."},
    ],
    [
        {"role": "user", "content": "Start without a system prompt."},
        {"role": "assistant", "content": "<think>\nShort.\n</think>\n\nFine."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Parts, "}, {"type": "text", "text": "two."}],
        },
        {"role": "assistant", "content": "Done."},
    ],
    [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "One."},
        {"role": "user", "content": "Two users in a row."},
    ],
)
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# Agent turns: calls, consecutive tool results, an answer after them.
_TOOL_CHATS: tuple[list[dict[str, Any]], ...] = (
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "content": "result one", "tool_call_id": "call_1"},
        {"role": "tool", "content": "result two", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "<think>\nCheck.\n</think>\n\nFound it."},
        {"role": "user", "content": "Thanks."},
    ],
)
_PLAIN_ROLES = frozenset(("system", "user", "assistant"))
# What stands before a later message when it is rendered alone: the segment of a message
# that is not first is its render after this one, minus this one's render.
_ANCHOR = {"role": "system", "content": "anchor"}
# Contents a template must render verbatim for its frames to stand in for it (_frame).
_FRAME_MARK = "\x00switchyard-content\x00"
_FRAME_PROBES = (
    "",
    "  spaces at both ends \n",
    "\nnewlines\n\n",
    "{{ braces }} {% raw %} <b>&amp;</b> 'quotes\" \\",
    "<think>thought</think>answer",
    "ünïcødé 😀",
)
_KEYS_HELD = 1024  # messages whose keys are remembered (about 50 chats of 20 messages)
_KEYS_HELD_CHARS = 4_000_000  # and the most content they may keep alive
_MAX_FRAMES = 64  # roles are a handful; past this many, a new role is rendered


@dataclass
class _Piece:
    """Text whose ids are not cached yet; ``key`` None when the text is not to be cached."""

    key: bytes | None
    text: str
    ids: list[int] | None = None


@dataclass
class _Text:
    """A text as cached ids and pieces to encode; ``key``: its message-cache key, if any.

    A chat's plan lists its new messages as ``children``, cached whole once encoded.
    """

    parts: list[list[int] | _Piece]
    key: bytes | None = None
    children: list[_Text] = field(default_factory=list)


@dataclass
class ChatPlan:
    """A chat's first ``count`` messages as a line seen before (``line``, of which ``shared``
    messages are these) and the messages it adds: each one's kept copy and its cached ids or
    pieces to encode, all in ``text``. ``new_chars``: characters to tokenize; ``left_out``:
    the characters of a last message left out of a head (0 when it is in)."""

    messages: list[dict[str, Any]]
    count: int
    anchors: list[bytes]
    line: Line | None
    shared: int
    new: list[tuple[Any, list[list[int] | _Piece]]]
    text: _Text
    suffix: list[int]
    new_chars: int
    left_out: int
    cached: list[bytes]


class _ByteLRU:
    """Token ids by content hash, least recently used out first, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits: dict[str, int] = {"message": 0, "piece": 0, "engine": 0}
        self.misses: dict[str, int] = {"message": 0, "piece": 0, "engine": 0}
        self._d: OrderedDict[bytes, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: bytes) -> bool:
        return key in self._d

    @staticmethod
    def cost(ids: list[int]) -> int:
        return _ENTRY_BYTES + _TOKEN_BYTES * len(ids)

    def get(self, key: bytes, kind: str) -> list[int] | None:
        ids = self._d.get(key)
        if ids is None:
            self.misses[kind] += 1
            return None
        self.hits[kind] += 1
        self._d.move_to_end(key)
        return ids

    def peek(self, key: bytes) -> list[int] | None:
        """``get`` without counting or refreshing: for a plan that may not be used."""
        return self._d.get(key)

    def used(self, kind: str, hits: list[bytes], misses: int) -> None:
        """Count and refresh what ``peek`` found once its plan is used."""
        self.hits[kind] += len(hits)
        self.misses[kind] += misses
        for key in hits:
            if key in self._d:
                self._d.move_to_end(key)

    def put(self, key: bytes, ids: list[int]) -> None:
        cost = self.cost(ids)
        if cost > self.max_bytes:
            return
        old = self._d.pop(key, None)
        if old is not None:
            self.bytes -= self.cost(old)
        self._d[key] = ids
        self.bytes += cost
        while self.bytes > self.max_bytes:
            _, dropped = self._d.popitem(last=False)
            self.bytes -= self.cost(dropped)


# Hash seeds keep the keys of first and later messages, pieces and engine answers apart.
_MESSAGE_SEED, _PIECE_SEED, _ENGINE_SEED, _FIRST_MESSAGE_SEED = 1, 2, 3, 4


def _digest(text: str, seed: int) -> bytes:
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"), seed)


def _message_key(message: Any, first: bool) -> bytes | None:
    """A hash of everything the template may read from a message (and whether it comes
    first, which templates often render differently); None if unhashable."""
    if not isinstance(message, dict):
        return None
    seed = _FIRST_MESSAGE_SEED if first else _MESSAGE_SEED
    role, content = message.get("role"), message.get("content")
    if len(message) == 2 and isinstance(role, str) and isinstance(content, str):
        return _digest(role + "\x00" + content, seed)
    try:
        text = json.dumps(message, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return _digest(text, seed)


def _plain(message: dict[str, Any]) -> bool:
    """A message of a plain chat: role and text content, no tool fields."""
    return message.keys() <= {"role", "content"} and message.get("role") in _PLAIN_ROLES


@dataclass(frozen=True)
class _ChatLayout:
    """How a template lays out a chat when it renders each message on its own."""

    prefix: str  # rendered before the first message (e.g. a BOS text)
    prefix_ids: list[int]
    suffix: str  # the generation prompt
    suffix_ids: list[int]
    starts: tuple[str, ...]  # special tokens a message may start with
    anchor: str  # the render of ``_ANCHOR`` alone
    tools: bool = False  # tool calls and results also render message by message


def _added_specials(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """What the post-processor wraps a single sequence in (e.g. BOS), learned from a probe."""
    bare = tokenizer.encode("routing probe", add_special_tokens=False).ids
    full = tokenizer.encode("routing probe", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []


def _render_plain_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """ChatML rendering for modes without a template (approximate mode)."""
    parts = []
    for m in messages:
        parts.append(f"<|im_start|>{m.get('role', '')}\n{_content_text(m.get('content'))}")
        parts.append("<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = (p.get("text") for p in content if isinstance(p, dict))
    return "".join(t for t in texts if isinstance(t, str))


def _cut_safe(token: AddedToken) -> bool:
    """A special token that takes no neighbouring whitespace: text around it tokenizes apart."""
    return not (token.lstrip or token.rstrip or token.single_word)


class RoutingTokenizer:
    """Prompt and chat tokenization with message and prefix caching; see the module docstring."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        engine_url: str | None = None,
        cache_bytes: int = CACHE_BYTES,
        conversation_bytes: int = CONVERSATION_BYTES,
    ) -> None:
        self._tok = tokenizer
        self._engine_url = engine_url.rstrip("/") if engine_url else None
        self._special = special_tokens or {}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(chat_template) if chat_template else None
        self._cache = _ByteLRU(cache_bytes)
        self.conversations = ConversationCache(conversation_bytes)
        self._bos: list[int] = []
        self._eos: list[int] = []
        self._split: re.Pattern[str] | None = None
        self._cuts: tuple[tuple[re.Pattern[str], bool], ...] = ()
        self._layout: _ChatLayout | None = None
        # (role, first) -> the text around a plain message's content; None: render it.
        self._frames: dict[tuple[str, bool], tuple[str, str] | None] = {}
        # id(message) -> (message, first, key): a request's messages are keyed once,
        # though the probe, the lookup and the warm-up each walk them.
        self._keys: dict[int, tuple[Any, bool, bytes | None]] = {}
        self._keys_chars = 0  # of the contents those entries keep alive
        self._executor: ThreadPoolExecutor | None = None
        self._queued = 0
        # Kept connections to the engine's /tokenize (``from_engine``), made on first use;
        # the pool belongs to the loop it was made on.
        self._pool: ConnectionPool | None = None
        self._fast: Encoder | None = None  # tiktoken, where it gives the tokenizer's ids
        # Told of each chat message tokenized here for the first time (its cache key and
        # ids), so that the router's other processes need not tokenize it again (``learn``).
        self.on_message: Callable[[bytes, list[int]], None] | None = None
        self.exact = tokenizer is not None or engine_url is not None
        self.cut_pieces = False
        if tokenizer is not None:
            self._bos, self._eos = _added_specials(tokenizer)
            added = [t for t in tokenizer.get_added_tokens_decoder().values() if t.content]
            specials = sorted((t.content for t in added), key=len, reverse=True)
            if specials and all(_cut_safe(t) for t in added):
                self._split = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
            self._cuts = self._exact_cuts()
            self.cut_pieces = self._split is not None or bool(self._cuts)
            self._fast = fast_encoder(tokenizer, self._split, _PROBES)
            self._layout = self._chat_layout(tuple(specials))

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        cache_bytes: int = CACHE_BYTES,
        conversation_bytes: int = CONVERSATION_BYTES,
    ) -> RoutingTokenizer:
        p = Path(path)
        tok = Tokenizer.from_file(str(p / "tokenizer.json"))
        template: str | None = None
        special: dict[str, str] = {}
        cfg_path = p / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            raw = cfg.get("chat_template")
            if isinstance(raw, list):
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default") or next(iter(named.values()), None)
            template = raw if isinstance(raw, str) else None
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                val = cfg.get(name)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    special[name] = val
        jinja = p / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        return cls(
            tokenizer=tok,
            chat_template=template,
            special_tokens=special,
            cache_bytes=cache_bytes,
            conversation_bytes=conversation_bytes,
        )

    @classmethod
    def approximate(cls) -> RoutingTokenizer:
        return cls()

    @classmethod
    def from_engine(cls, base_url: str, cache_bytes: int = CACHE_BYTES) -> RoutingTokenizer:
        """Ask the engine's ``/tokenize`` (vLLM/SGLang shape); answers are cached."""
        return cls(engine_url=base_url, cache_bytes=cache_bytes)

    @property
    def mode(self) -> str:
        if self._tok is not None:
            return "hf"
        return "engine" if self._engine_url else "approximate"

    @property
    def incremental(self) -> bool:
        """Whether chats are tokenized message by message (the template allows it)."""
        return self._layout is not None

    @property
    def cache_stats(self) -> dict[str, Any]:
        c = self._cache
        return {
            "hits": sum(c.hits.values()),
            "misses": sum(c.misses.values()),
            "by_kind": {
                **{k: (c.hits[k], c.misses[k]) for k in c.hits},
                "conversation": (self.conversations.hits, self.conversations.misses),
            },
            "bytes": c.bytes,
            "max_bytes": c.max_bytes,
            "entries": len(c),
            "conversations": {
                "hits": self.conversations.hits,
                "misses": self.conversations.misses,
                "entries": len(self.conversations),
                "bytes": self.conversations.bytes,
            },
        }

    # -- local (hf / approximate) ----------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt, as the engine tokenizes it (special tokens on).

        Local modes only: an engine-backed tokenizer is asked through ``aencode_prompt``.
        """
        if isinstance(prompt, list):
            return prompt
        if self._tok is None:
            self._local_only("aencode_prompt")
            return self._approx(prompt)
        return self._wrap(self._finish(self._text_plan(prompt), self._encode))

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat request: template rendered, then tokenized without specials.

        Local modes only: an engine-backed tokenizer is asked through ``aencode_chat``.
        """
        if self._tok is None:
            self._local_only("aencode_chat")
            return self._approx(_render_plain_chat(messages, add_generation_prompt))
        plan = self.plan_chat(messages, add_generation_prompt)
        if plan is not None:
            self._finish(plan.text, self._encode)
            return self._commit(plan).ids()
        return self._finish(self._chat_plan(messages, add_generation_prompt), self._encode)

    def encode_head(self, text: str, max_chars: int, *, prompt: bool) -> list[int] | None:
        """Tokens that certainly begin ``text``'s encoding, from about ``max_chars`` of it.

        Cut at whitespace (the pre-tokenizer never joins across it) and drop the last two
        tokens, so the head is a true prefix of the whole encoding; ``prompt`` adds the
        specials a completion prompt starts with. None when no safe cut exists. Pieces
        shared with earlier prompts come from the piece cache, as for whole prompts.
        """
        cut = self._head_cut(text, max_chars)
        if cut is None:
            return None
        ids = self._finish(self._text_plan(text[:cut]), self._encode)[:-2]
        return self._bos + ids if prompt else ids

    async def aencode_head(self, text: str, max_chars: int, *, prompt: bool) -> list[int] | None:
        """``encode_head`` with a long uncached head tokenized off the event loop."""
        cut = self._head_cut(text, max_chars)
        if cut is None:
            return None
        ids = (await self._run(self._text_plan(text[:cut])))[:-2]
        return self._bos + ids if prompt else ids

    def uncached_chars(self, messages: list[dict[str, Any]]) -> int | None:
        """Characters of ``messages`` not in the message cache; None without incremental chats.

        Cheap (one hash per message): the router asks it to choose between a whole-prompt
        lookup and the head probe.
        """
        if self._layout is None:
            return None
        total = 0
        for i, m in enumerate(messages):
            key = self._key_of(m, i == 0)
            if key is None or not (self._layout.tools or _plain(m)):
                return None
            if key not in self._cache:
                total += len(_content_text(m.get("content"))) + _FRAME_CHARS
        return total

    def _key_of(self, message: Any, first: bool) -> bytes | None:
        """``_message_key``, remembered for the message object while it is recent (the
        entry holds it, so its id is not reused meanwhile)."""
        held = self._keys.get(id(message))
        if held is not None and held[0] is message and held[1] is first:
            return held[2]
        key = _message_key(message, first)
        content = message.get("content") if isinstance(message, dict) else None
        size = len(content) if isinstance(content, str) else 0
        if len(self._keys) >= _KEYS_HELD or self._keys_chars + size > _KEYS_HELD_CHARS:
            self._keys.clear()
            self._keys_chars = 0
        self._keys[id(message)] = (message, first, key)
        self._keys_chars += size
        return key

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            return _render_plain_chat(messages, add_generation_prompt)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._special
        )

    def chat_text(self, messages: list[dict[str, Any]]) -> str:
        """The text of ``render_chat(messages)``: joined from the messages' segments (most
        framed without the template) where the template renders message by message."""
        layout = self._layout
        if layout is not None:
            parts = [layout.prefix]
            for i, m in enumerate(messages):
                segment = self._segment(m, layout, i == 0) if layout.tools or _plain(m) else None
                if segment is None:
                    return self.render_chat(messages)
                parts.append(segment)
            parts.append(layout.suffix)
            return "".join(parts)
        return self.render_chat(messages)

    def _head_cut(self, text: str, max_chars: int) -> int | None:
        if self._tok is None or len(text) <= max_chars:
            return None
        cut = text.rfind(" ", 0, max_chars)
        return cut if cut > 0 else None

    def _wrap(self, ids: list[int]) -> list[int]:
        return self._bos + ids + self._eos if self._bos or self._eos else ids

    # -- plans: what is cached, what is to encode ------------------------------------------

    def _text_plan(self, text: str, key: bytes | None = None) -> _Text:
        if not self.cut_pieces:
            return _Text([_Piece(None, text)], key)
        get = self._cache.get
        parts: list[list[int] | _Piece] = []
        for piece in self._pieces(text):
            pkey = _digest(piece, _PIECE_SEED)
            ids = get(pkey, "piece")
            parts.append(ids if ids is not None else _Piece(pkey, piece))
        return _Text(parts, key)

    def _chat_plan(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> _Text:
        """Messages from the cache where the template allows it; else one full render."""
        plan = self._message_plan(messages, add_generation_prompt)
        if plan is None:
            return self._text_plan(self.render_chat(messages, add_generation_prompt))
        return plan

    def _message_plan(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> _Text | None:
        """The chat message by message (cached ones as ids); None where the template
        does not render them one by one."""
        layout = self._layout
        if layout is None:
            return None
        parts: list[list[int] | _Piece] = [layout.prefix_ids]
        texts: list[_Text] = []
        for i, m in enumerate(messages):
            key = self._key_of(m, i == 0)
            if key is None or not (layout.tools or _plain(m)):
                return None
            ids = self._cache.get(key, "message")
            if ids is not None:
                parts.append(ids)
                continue
            segment = self._segment(m, layout, i == 0)
            if segment is None:
                return None
            text = self._text_plan(segment, key)
            texts.append(text)
            parts.extend(text.parts)
        if add_generation_prompt:
            parts.append(layout.suffix_ids)
        return _Text(parts, children=texts)

    def plan_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        head: bool = False,
    ) -> ChatPlan | None:
        """What a chat adds to the conversation line it extends (``kvstore.conversation``);
        None where the template does not render message by message, or no local tokenizer.

        ``head``: leave the last message and the generation prompt out unless the line
        holds that message already: no engine holds the KV of a turn its router never saw
        (see ``aencode_chat_head``). Cheap: the first two messages are hashed to find the
        line, the rest compared with it; only messages past it are looked up and cut.
        """
        layout = self._layout
        if layout is None or self._tok is None or not messages:
            return None
        n = len(messages)
        first = self._key_of(messages[0], True)
        if first is None:
            return None
        anchors = [first]
        if n >= 2:
            second = self._key_of(messages[1], False)
            if second is None:
                return None
            anchors.insert(0, first + second)
        found = self.conversations.find(anchors, messages, n)
        line, shared = found if found is not None else (None, 0)
        count, suffix, left_out = n, layout.suffix_ids if add_generation_prompt else [], 0
        if head and shared < n and n >= 2:
            last = messages[-1]
            if not isinstance(last, dict) or not (layout.tools or _plain(last)):
                return None
            count, suffix = n - 1, []
            left_out = len(_content_text(last.get("content"))) + _FRAME_CHARS + len(layout.suffix)
        shared = min(shared, count)
        new: list[tuple[Any, list[list[int] | _Piece]]] = []
        parts: list[list[int] | _Piece] = []
        children: list[_Text] = []
        cached: list[bytes] = []  # message-cache keys it found, counted once it is used
        new_chars = 0
        for i in range(shared, count):
            m = messages[i]
            key = self._key_of(m, i == 0)
            if key is None or not (layout.tools or _plain(m)):
                return None
            ids = self._cache.peek(key)
            if ids is not None:
                own: list[list[int] | _Piece] = [ids]
                cached.append(key)
            else:
                segment = self._segment(m, layout, i == 0)
                if segment is None:
                    return None
                text = self._text_plan(segment, key)
                children.append(text)
                own = text.parts
                new_chars += len(segment)
            kept = dict(m) if _plain(m) else copy.deepcopy(m)
            new.append((kept, own))
            parts.extend(own)
        return ChatPlan(
            messages, count, anchors, line, shared, new,
            _Text(parts, children=children), suffix, new_chars, left_out, cached,
        )  # fmt: skip

    async def aencode_plan(self, plan: ChatPlan) -> ChatPrefix:
        """The chat ``plan`` describes, its new text tokenized off the event loop if long."""
        await self._run(plan.text)
        return self._commit(plan)

    def _commit(self, plan: ChatPlan) -> ChatPrefix:
        """Extend the plan's line by its new messages (encoded by now), or branch from it."""
        self._cache.used("message", plan.cached, len(plan.text.children))
        lengths = [sum(len(p) if isinstance(p, list) else len(p.ids or ()) for p in parts)
                   for _, parts in plan.new]  # fmt: skip
        ids = _joined(plan.text.parts)
        line, shared = plan.line, plan.shared
        anchor = plan.anchors[0] if plan.count >= 2 else plan.anchors[-1]
        if line is None:
            assert self._layout is not None
            prefix = self._layout.prefix_ids
            line = Line(anchor, [], [len(prefix)], list(prefix))
        elif plan.new and (len(line.messages) != shared or shared < 2):
            # Past the shared part (a branch), or a line a conversation may only start
            # from (a system prompt), or it grew while this chat's text was tokenized.
            line = line.branch(anchor, shared)
        if plan.new:
            line.extend([m for m, _ in plan.new], lengths, ids)
        self.conversations.put(line)
        return ChatPrefix(line, plan.count, plan.suffix)

    async def aencode_chat_head(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[int], int] | None:
        """The ids of a chat without its last message, when this tokenizer has not seen
        that message, and the characters left out (that message and the generation prompt).

        No engine holds the KV of a message its router never saw (a repeat is cached once
        its first answer came, so it is seen), so routing needs only the length of that
        message: the next turn's new user text, most of what a turn adds on the multi-turn
        bench. None where
        the template does not render message by message, or the last message is cached.
        """
        layout = self._layout
        if layout is None or self._tok is None or self._engine_url is not None:
            return None
        if len(messages) < 2:
            return None  # a single message is its own head: nothing to leave out
        last = messages[-1]
        key = self._key_of(last, False)
        if key is None or key in self._cache or not (layout.tools or _plain(last)):
            return None
        plan = self._message_plan(messages[:-1], add_generation_prompt=False)
        if plan is None:
            return None
        left_out = len(_content_text(last.get("content"))) + _FRAME_CHARS + len(layout.suffix)
        return await self._run(plan), left_out

    def _segment(self, message: dict[str, Any], layout: _ChatLayout, first: bool) -> str | None:
        """One message's part of a render, when it starts at a boundary no token crosses.

        A plain message (a role and a string) is framed without the template once the
        template proved to put such content in as it is (``_frame``): a template render
        per message was a visible part of a multi-turn request's router time.
        """
        role, content = message.get("role"), message.get("content")
        if len(message) == 2 and isinstance(role, str) and isinstance(content, str):
            frame = self._frame(role, layout, first)
            if frame is not None:
                return frame[0] + content + frame[1]
        return self._render_segment(message, layout, first)

    def _frame(self, role: str, layout: _ChatLayout, first: bool) -> tuple[str, str] | None:
        """The text before and after a plain ``role`` message's content, when the template
        renders every probe content (ends of whitespace, markup, braces, think tags,
        non-ASCII, nothing) verbatim between them; else None. Learned once per role."""
        if (role, first) in self._frames:
            return self._frames[(role, first)]
        if len(self._frames) >= _MAX_FRAMES:
            return None  # invented roles are rendered, not learned on every message
        frame: tuple[str, str] | None = None
        marked = self._render_segment({"role": role, "content": _FRAME_MARK}, layout, first)
        if marked is not None and marked.count(_FRAME_MARK) == 1:
            before, after = marked.split(_FRAME_MARK)
            if all(
                self._render_segment({"role": role, "content": probe}, layout, first)
                == before + probe + after
                for probe in _FRAME_PROBES
            ):
                frame = (before, after)
        self._frames[(role, first)] = frame
        return frame

    def _render_segment(
        self, message: dict[str, Any], layout: _ChatLayout, first: bool
    ) -> str | None:
        """``_segment`` by the template: the first message is rendered alone; a later one
        after ``_ANCHOR``, less the anchor's own render (so "first message" rules of a
        template do not apply to it)."""
        before = layout.prefix if first else layout.anchor
        try:
            text = self.render_chat([message] if first else [_ANCHOR, message], False)
        except Exception:
            return None
        if not text.startswith(before):
            return None
        text = text[len(before) :]
        return text if text.startswith(layout.starts) else None

    def learn(self, key: bytes, ids: list[int]) -> None:
        """Cache a chat message another process of the router tokenized (``on_message``)."""
        if key not in self._cache:
            self._cache.put(key, ids)

    @staticmethod
    def _missing(plan: _Text) -> list[_Piece]:
        return [p for p in plan.parts if isinstance(p, _Piece)]

    def _finish(self, plan: _Text, encode: Callable[[list[str]], list[list[int]]]) -> list[int]:
        """Encode what is missing, cache it (pieces and whole messages), join the ids."""
        missing = self._missing(plan)
        if missing:
            for piece, ids in zip(missing, encode([p.text for p in missing]), strict=True):
                piece.ids = ids
        return self._assemble(plan)

    def _assemble(self, plan: _Text) -> list[int]:
        cache, told = self._cache, self.on_message
        for child in plan.children:
            assert child.key is not None
            ids = _joined(child.parts)
            if told is not None and child.key not in cache:
                told(child.key, ids)
            cache.put(child.key, ids)
        out = _joined(plan.parts)
        for part in plan.parts:
            if isinstance(part, _Piece) and part.key is not None:
                assert part.ids is not None
                cache.put(part.key, part.ids)
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Inline or in the worker thread, with tiktoken where it is exact (``kvstore.bpe``;
        it releases the GIL too). Else HF's ``encode_batch_fast``, which releases the GIL
        (``encode`` does not) and skips the offsets. One text a call: a batch of several
        spreads them over rayon's threads, which cost more than they gave on the
        multi-turn bench's new messages."""
        if self._fast is not None:
            return [self._fast(t) for t in texts]
        assert self._tok is not None
        fast = self._tok.encode_batch_fast
        return [fast([t], add_special_tokens=False)[0].ids for t in texts]

    async def _run(self, plan: _Text) -> list[int]:
        """Small uncached text inline; long, or anything while the thread has a queue, there.

        The worker thread is one, first in first out, so requests sent to it resume in
        the order they came, and none overtakes a request queued before it.
        """
        missing = self._missing(plan)
        if not self._queued and sum(len(p.text) for p in missing) <= OFFLOAD_CHARS:
            return self._finish(plan, self._encode)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="switchyard-tokenize")
        texts = [p.text for p in missing]
        self._queued += 1
        try:
            loop = asyncio.get_running_loop()
            encoded = await loop.run_in_executor(self._executor, self._encode, texts)
        finally:
            self._queued -= 1
        for piece, ids in zip(missing, encoded, strict=True):
            piece.ids = ids
        return self._assemble(plan)

    def _pieces(self, text: str) -> list[str]:
        """Cut ``text`` where no token can span: around special tokens, then in the text.

        Cuts are chosen from the start of each segment, every ``MIN_PIECE_CHARS`` at
        least, so two texts that share a prefix are cut alike up to where they differ.
        """
        segments = self._split.split(text) if self._split is not None else [text]
        pieces: list[str] = []
        for seg in segments:
            if not seg:
                continue
            if len(seg) <= 2 * MIN_PIECE_CHARS or not self._cuts:
                pieces.append(seg)
                continue
            start = 0
            for cut in self._cut_points(seg):
                if cut - start >= MIN_PIECE_CHARS and len(seg) - cut >= MIN_PIECE_CHARS:
                    pieces.append(seg[start:cut])
                    start = cut
            pieces.append(seg[start:])
        return pieces

    def _cut_points(self, seg: str) -> list[int]:
        """Where each cut rule allows a cut, at most one per ``MIN_PIECE_CHARS`` per rule.

        Each search starts a piece's length after the last point found, so a long text is
        scanned about once per rule, whatever its number of pieces.
        """
        points: list[int] = []
        for pattern, after in self._cuts:
            pos = MIN_PIECE_CHARS
            while True:
                m = pattern.search(seg, pos)
                if m is None:
                    break
                cut = m.end() if after else m.start()
                points.append(cut)
                pos = cut + MIN_PIECE_CHARS
        if len(self._cuts) > 1:
            points.sort()
        return points

    def _exact_cuts(self) -> tuple[tuple[re.Pattern[str], bool], ...]:
        """The cut rules that give exactly the uncut ids on every probe text."""
        assert self._tok is not None
        enc = self._tok.encode
        kept = []
        for pattern, after in ((_NEWLINE_CUT, True), (_SPACE_CUT, False)):
            exact = True
            for probe in _PROBES:
                whole = enc(probe, add_special_tokens=False).ids
                for m in pattern.finditer(probe):
                    cut = m.end() if after else m.start()
                    left = enc(probe[:cut], add_special_tokens=False).ids
                    right = enc(probe[cut:], add_special_tokens=False).ids
                    if left + right != whole:
                        exact = False
            if exact:
                kept.append((pattern, after))
        return tuple(kept)

    def _chat_layout(self, specials: tuple[str, ...]) -> _ChatLayout | None:
        """The layout when message-by-message ids equal a full render's on every sample chat.

        Needs a template, special tokens to cut at, each message starting with one, and
        the same text and ids as the full render (with and without the generation prompt).
        Tool calls and results are checked apart: a template that groups them renders
        plain chats message by message still.
        """
        if self._template is None or self._tok is None or self._split is None:
            return None
        try:
            prefix = self.render_chat([], add_generation_prompt=False)
            with_prompt = self.render_chat([], add_generation_prompt=True)
            anchor = self.render_chat([_ANCHOR], add_generation_prompt=False)
        except Exception:
            return None
        if not with_prompt.startswith(prefix):
            return None
        suffix = with_prompt[len(prefix) :]
        if suffix and not suffix.startswith(specials):
            return None
        enc = self._tok.encode
        layout = _ChatLayout(
            prefix,
            enc(prefix, add_special_tokens=False).ids if prefix else [],
            suffix,
            enc(suffix, add_special_tokens=False).ids if suffix else [],
            specials,
            anchor,
        )
        if not all(self._renders_alike(chat, layout) for chat in _SAMPLE_CHATS):
            return None
        tools = all(self._renders_alike(chat, layout) for chat in _TOOL_CHATS)
        return dataclasses.replace(layout, tools=tools)

    def _renders_alike(self, chat: list[dict[str, Any]], layout: _ChatLayout) -> bool:
        """Whether ``chat`` joined from its segments gives the full render's text and ids."""
        assert self._tok is not None
        enc = self._tok.encode
        segments = [self._segment(m, layout, i == 0) for i, m in enumerate(chat)]
        if any(s is None for s in segments):
            return False
        for agp in (False, True):
            try:
                full = self.render_chat(chat, add_generation_prompt=agp)
            except Exception:
                return False
            joined = (
                layout.prefix + "".join(s for s in segments if s) + (layout.suffix if agp else "")
            )
            if joined != full:
                return False
            ids = list(layout.prefix_ids)
            for s in segments:
                ids += enc(s or "", add_special_tokens=False).ids
            if agp:
                ids += layout.suffix_ids
            if ids != enc(full, add_special_tokens=False).ids:
                return False
        return True

    def _approx(self, text: str) -> list[int]:
        h = xxhash.xxh32_intdigest
        return [
            h(text[i : i + CHARS_PER_TOKEN].encode()) & 0x7FFFFFFF
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]

    # -- engine /tokenize ------------------------------------------------------------------

    def _engine_key(self, body: dict[str, Any]) -> bytes:
        return _digest(json.dumps(body, sort_keys=True), _ENGINE_SEED)

    def _local_only(self, instead: str) -> None:
        """Refuse a blocking call in engine mode: it would wait for the engine's answer on
        the event loop, stalling every request in flight meanwhile."""
        if self._engine_url is not None:
            raise RuntimeError(
                f"this tokenizer asks the engine at {self._engine_url}: use {instead}, "
                "which awaits the answer instead of blocking"
            )

    def _engine_pool(self) -> ConnectionPool:
        """The kept pool to the engine, made on first use on the running loop (and again if
        the loop changed: a pool's connections belong to the loop that opened them)."""
        pool = self._pool
        if pool is None or pool.loop is not asyncio.get_running_loop():
            pool = self._pool = ConnectionPool(
                connect_timeout_s=_ENGINE_TIMEOUT_S,
                max_per_origin=_ENGINE_CONNECTIONS,
                keepalive_s=_ENGINE_KEEPALIVE_S,
            )
        return pool

    async def _engine_tokenize(self, body: dict[str, Any]) -> list[int]:
        """The engine's ids for ``body``, cached by its content. Transport failures raise
        ``switchyard.net.errors.TransportError`` (a timeout also ``TimeoutError``); an
        answer that is not 2xx with a ``tokens`` list raises ``ValueError``."""
        key = self._engine_key(body)
        ids = self._cache.get(key, "engine")
        if ids is None:
            url = f"{self._engine_url}/tokenize"
            async with asyncio.timeout(_ENGINE_TIMEOUT_S):
                answer = await self._engine_pool().post(url, orjson.dumps(body), _JSON)
                try:
                    raw = await answer.read()
                finally:
                    answer.close()
            if not 200 <= answer.status < 300:
                raise ValueError(f"engine /tokenize answered HTTP {answer.status}")
            tokens = orjson.loads(raw).get("tokens")
            if not isinstance(tokens, list):
                raise ValueError("engine /tokenize answered without a tokens list")
            ids = [int(t) for t in tokens]
            self._cache.put(key, ids)
        return ids

    async def aencode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Like ``encode_prompt``, with long uncached text tokenized off the event loop."""
        if isinstance(prompt, list):
            return prompt
        if self._engine_url is not None:
            return await self._engine_tokenize({"prompt": prompt})
        if self._tok is None:
            return self._approx(prompt)
        return self._wrap(await self._run(self._text_plan(prompt)))

    async def aencode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Like ``encode_chat``, with long uncached messages tokenized off the event loop."""
        if self._engine_url is not None:
            return await self._engine_tokenize(
                {"messages": messages, "add_generation_prompt": add_generation_prompt}
            )
        if self._tok is None:
            return self.encode_chat(messages, add_generation_prompt)
        plan = self.plan_chat(messages, add_generation_prompt)
        if plan is not None:
            return (await self.aencode_plan(plan)).ids()
        return await self._run(self._chat_plan(messages, add_generation_prompt))

    def close(self) -> None:
        """Stop the worker thread (a new one starts if tokenization is asked again); the
        engine's connections are closed by ``aclose``, on their loop."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def aclose(self) -> None:
        """``close``, and the kept engine connections too (new ones are made if asked
        again). A pool of another loop is dropped: its loop has ended or is not ours."""
        self.close()
        pool, self._pool = self._pool, None
        if pool is not None and pool.loop is asyncio.get_running_loop():
            await pool.close()


def _joined(parts: list[list[int] | _Piece]) -> list[int]:
    out: list[int] = []
    for part in parts:
        if isinstance(part, _Piece):
            assert part.ids is not None
            out.extend(part.ids)
        else:
            out.extend(part)
    return out
