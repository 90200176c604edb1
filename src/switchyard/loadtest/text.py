"""Deterministic filler text whose token count is known exactly.

Every word is a whole-word vocabulary entry of the shipped byte-level BPE tokenizer
(``Ġword``), and the pre-tokenizer splits text on spaces before BPE runs, so
``" w1 w2 … wn"`` encodes to exactly n tokens. That lets a workload say "512 tokens"
and mean it, for the mock engines, the router and the ceiling model alike.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

from switchyard.mock.settings import DEFAULT_TOKENIZER


class WordBank:
    """Single-token words of one tokenizer, and seeded texts built from them."""

    def __init__(self, tokenizer_dir: str | Path = DEFAULT_TOKENIZER) -> None:
        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        candidates = sorted(
            t[1:]
            for t in tok.get_vocab()
            if t.startswith("Ġ") and len(t) >= 4 and t[1:].isascii() and t[1:].isalpha()
        )
        encoded = tok.encode_batch([" " + w for w in candidates], add_special_tokens=False)
        self.words = [w for w, e in zip(candidates, encoded, strict=True) if len(e.ids) == 1]
        if len(self.words) < 100:
            raise ValueError(f"{tokenizer_dir}: too few single-token words ({len(self.words)})")

    def text(self, seed: int | str, n_tokens: int) -> str:
        """``n_tokens`` words chosen by ``seed``; a shorter count gives a prefix of a longer."""
        rng = random.Random(f"wordbank:{seed}")
        words = self.words
        return "".join(" " + words[rng.randrange(len(words))] for _ in range(n_tokens))


@cache
def default_bank() -> WordBank:
    return WordBank()
