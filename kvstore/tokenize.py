"""Tokenization for routing: the same token ids the engine will see, computed cheaply.

Three modes:
- a Hugging Face tokenizer directory (``tokenizer.json`` + the Jinja ``chat_template`` of
  ``tokenizer_config.json``), exact;
- an engine's ``/tokenize`` endpoint, exact, cached per distinct prompt;
- an approximate character mode (no tokenizer at all): stable pseudo-tokens, one per
  ``CHARS_PER_TOKEN`` characters, good enough to see shared prefixes, marked ``exact=False``.

Repeated prefixes are not re-tokenized: text is cut at boundaries no token can cross
(special tokens such as ``<|im_start|>``, and a lone newline between two non-space
characters for byte-level BPE), and the ids of each piece are cached. A probe at load
time checks that cutting is exact for this tokenizer and turns it off if not.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# Characters per token when no tokenizer is at hand (also the router's token estimate).
CHARS_PER_TOKEN = 4
# Pieces shorter than this are merged with their neighbour before caching.
MIN_PIECE_CHARS = 256
_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_PROBES = (
    "Hello world.\nSecond line, with words.\n\nThird paragraph: 42 apples\n  indented\nend",
    "def f(x):\n    return x + 1\n# comment\nclass A:\n    pass\n",
    "Ünïcödé text\nnext 🙂 line\n\tTabbed\nlast",
)


class _LRU:
    """A bounded piece -> ids cache (by total cached tokens, so long pieces count fully)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, key: str) -> list[int] | None:
        ids = self._d.get(key)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return ids

    def put(self, key: str, ids: list[int]) -> None:
        if len(ids) > self.max_tokens:
            return
        old = self._d.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._d[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, dropped = self._d.popitem(last=False)
            self.tokens -= len(dropped)


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
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


class RoutingTokenizer:
    """Prompt and chat tokenization with prefix caching; see the module docstring."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        engine_url: str | None = None,
        cache_tokens: int = 4_000_000,
    ) -> None:
        self._tok = tokenizer
        self._engine_url = engine_url.rstrip("/") if engine_url else None
        self._special = special_tokens or {}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(chat_template) if chat_template else None
        self._cache = _LRU(cache_tokens)
        self._bos: list[int] = []
        self._eos: list[int] = []
        self._split: re.Pattern[str] | None = None
        self.exact = tokenizer is not None or engine_url is not None
        self.cut_pieces = False
        if tokenizer is not None:
            self._bos, self._eos = _added_specials(tokenizer)
            specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
            specials = sorted((s for s in specials if s), key=len, reverse=True)
            if specials:
                self._split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
            self.cut_pieces = self._cutting_is_exact()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, cache_tokens: int = 4_000_000) -> RoutingTokenizer:
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
            tokenizer=tok, chat_template=template, special_tokens=special, cache_tokens=cache_tokens
        )

    @classmethod
    def approximate(cls) -> RoutingTokenizer:
        return cls()

    @classmethod
    def from_engine(cls, base_url: str, cache_tokens: int = 4_000_000) -> RoutingTokenizer:
        """Ask the engine's ``/tokenize`` (vLLM/SGLang shape); answers are cached."""
        return cls(engine_url=base_url, cache_tokens=cache_tokens)

    @property
    def mode(self) -> str:
        if self._tok is not None:
            return "hf"
        return "engine" if self._engine_url else "approximate"

    @property
    def cache_stats(self) -> dict[str, int]:
        return {
            "hits": self._cache.hits,
            "misses": self._cache.misses,
            "tokens": self._cache.tokens,
        }

    # -- local (hf / approximate) ----------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt, as the engine tokenizes it (special tokens on)."""
        if isinstance(prompt, list):
            return prompt
        if self._tok is None:
            if self._engine_url is not None:
                return self._engine_tokenize_sync({"prompt": prompt})
            return self._approx(prompt)
        ids = self._encode_text(prompt)
        return self._bos + ids + self._eos if self._bos or self._eos else ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat request: template rendered, then tokenized without specials."""
        if self._tok is None:
            if self._engine_url is not None:
                return self._engine_tokenize_sync(
                    {"messages": messages, "add_generation_prompt": add_generation_prompt}
                )
            return self._approx(_render_plain_chat(messages, add_generation_prompt))
        return self._encode_text(self.render_chat(messages, add_generation_prompt))

    def encode_head(self, text: str, max_chars: int, *, prompt: bool) -> list[int] | None:
        """Tokens that certainly begin ``text``'s encoding, from about ``max_chars`` of it.

        Cut at whitespace (the pre-tokenizer never joins across it) and drop the last two
        tokens, so the head is a true prefix of the whole encoding; ``prompt`` adds the
        specials a completion prompt starts with. None when no safe cut exists. Pieces
        shared with earlier prompts come from the piece cache, as for whole prompts.
        """
        if self._tok is None or len(text) <= max_chars:
            return None
        cut = text.rfind(" ", 0, max_chars)
        if cut <= 0:
            return None
        ids = self._encode_text(text[:cut])[:-2]
        return self._bos + ids if prompt else ids

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            return _render_plain_chat(messages, add_generation_prompt)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._special
        )

    def _encode_text(self, text: str) -> list[int]:
        assert self._tok is not None
        if not self.cut_pieces:
            return self._tok.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        pieces = self._pieces(text)
        for piece in pieces:
            ids = self._cache.get(piece)
            if ids is None:
                ids = self._tok.encode(piece, add_special_tokens=False).ids
                self._cache.put(piece, ids)
            out.extend(ids)
        return out

    def _pieces(self, text: str) -> list[str]:
        """Cut ``text`` where no token can span: around special tokens, then at line starts."""
        segments = self._split.split(text) if self._split is not None else [text]
        pieces: list[str] = []
        for seg in segments:
            if not seg:
                continue
            if len(seg) <= MIN_PIECE_CHARS:
                pieces.append(seg)
                continue
            start = 0
            for m in _CUT.finditer(seg):
                cut = m.end()
                if cut - start >= MIN_PIECE_CHARS:
                    pieces.append(seg[start:cut])
                    start = cut
            pieces.append(seg[start:])
        return [p for p in pieces if p]

    def _cutting_is_exact(self) -> bool:
        assert self._tok is not None
        enc = self._tok.encode
        for probe in _PROBES:
            whole = enc(probe, add_special_tokens=False).ids
            for m in _CUT.finditer(probe):
                left = enc(probe[: m.end()], add_special_tokens=False).ids
                right = enc(probe[m.end() :], add_special_tokens=False).ids
                if left + right != whole:
                    return False
        return True

    def _approx(self, text: str) -> list[int]:
        h = xxhash.xxh32_intdigest
        return [
            h(text[i : i + CHARS_PER_TOKEN].encode()) & 0x7FFFFFFF
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]

    # -- engine /tokenize ------------------------------------------------------------------

    def _engine_body(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return json.dumps(body, sort_keys=True), body

    def _engine_tokenize_sync(self, body: dict[str, Any]) -> list[int]:
        key, body = self._engine_body(body)
        ids = self._cache.get(key)
        if ids is None:
            r = httpx.post(f"{self._engine_url}/tokenize", json=body, timeout=5.0)
            r.raise_for_status()
            ids = list(r.json()["tokens"])
            self._cache.put(key, ids)
        return ids

    async def _engine_tokenize(self, body: dict[str, Any]) -> list[int]:
        key, body = self._engine_body(body)
        ids = self._cache.get(key)
        if ids is None:
            async with httpx.AsyncClient(timeout=5.0) as client:
                r = await client.post(f"{self._engine_url}/tokenize", json=body)
            r.raise_for_status()
            ids = list(r.json()["tokens"])
            self._cache.put(key, ids)
        return ids

    async def aencode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Like ``encode_prompt`` but never blocks the event loop in engine mode."""
        if self._engine_url is not None and isinstance(prompt, str):
            return await self._engine_tokenize({"prompt": prompt})
        return self.encode_prompt(prompt)

    async def aencode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        if self._engine_url is not None:
            return await self._engine_tokenize(
                {"messages": messages, "add_generation_prompt": add_generation_prompt}
            )
        return self.encode_chat(messages, add_generation_prompt)
