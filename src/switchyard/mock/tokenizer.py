"""The model directory's tokenizer and chat template, as a real engine loads them.

Uses the HF ``tokenizer.json`` through ``tokenizers`` and renders the Jinja
``chat_template`` of ``tokenizer_config.json``, so prompt token counts (and thus
prefix-cache hits) match what the router computes from the same directory.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# One filler word whose repetition tokenizes to exactly one token per word, so
# the generated text re-tokenizes to the number of tokens the engine produced.
FILLER_WORD = " the"
# Token ids of text between special tokens kept for the next prompt that repeats it.
PIECE_CACHE_TOKENS = 1_000_000


class TemplateError(ValueError):
    """The chat template could not render these messages (a client error)."""


class ModelTokenizer:
    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = json.loads((path / "tokenizer_config.json").read_text())
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(config.get("chat_template") or "")
        self._special = {
            k: config.get(k) for k in ("bos_token", "eos_token", "pad_token") if config.get(k)
        }
        self.vocab_size = self._tok.get_vocab_size()
        ids = self._tok.encode(FILLER_WORD * 4, add_special_tokens=False).ids
        if len(ids) != 4 or len(set(ids)) != 1:
            raise ValueError(f"{path}: filler word {FILLER_WORD!r} is not a single token")
        self.filler_token_id = ids[0]
        self._specials = {
            t.content: i
            for i, t in self._tok.get_added_tokens_decoder().items()
            if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        }
        self._split = (
            re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")
            if self._specials
            else None
        )
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._piece_tokens = 0

    def encode(self, text: str) -> list[int]:
        """The same ids as ``Tokenizer.encode`` (no added specials), with the text between
        special tokens taken from a cache when a prompt repeats it, so a chat's earlier turns
        are tokenized once. Engines do not cache this; the mock's tokenizing is not what it
        models. Exact because a special token matched as written and taking no neighbouring
        whitespace splits the text before the model sees it. Tokenizing every prompt whole
        was most of the mock fleet's CPU under ``bench.kv_throughput``."""
        parts = self._split.split(text) if self._split is not None else [text]
        if len(parts) == 1:
            return self._encode_fast(text)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._specials[part])
            elif part:
                ids += self._piece(part)
        return ids

    def _piece(self, text: str) -> list[int]:
        cached = self._pieces.get(text)
        if cached is not None:
            self._pieces.move_to_end(text)
            return cached
        ids = self._encode_fast(text)
        self._pieces[text] = ids
        self._piece_tokens += len(ids) + 1
        while self._piece_tokens > PIECE_CACHE_TOKENS:
            _, old = self._pieces.popitem(last=False)
            self._piece_tokens -= len(old) + 1
        return ids

    def _encode_fast(self, text: str) -> list[int]:
        """``Tokenizer.encode``'s ids without its offsets, which a long prompt pays for and
        the mock never reads."""
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special
            )
        except (jinja2.TemplateError, TypeError, KeyError) as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]
