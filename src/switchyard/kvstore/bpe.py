"""A faster encoder for byte-level BPE tokenizers: tiktoken, used only where it is exact.

The router tokenizes every new message and prompt piece it routes, with HF ``tokenizers``
a large share of its CPU under ``bench.kv_throughput`` and on the Mooncake replay.
tiktoken runs the same byte-level BPE (a regex pre-split, then merges by rank) several
times faster, with the same ids on every text checked
(``docs/decisions/0006-bpe-fast-path.md``).

It applies when ``tokenizer.json`` is a plain byte-level BPE: no normalizer, a GPT-2
``ByteLevel`` pre-tokenizer with its regex, or one regex ``Split`` then ``ByteLevel``
without (Llama 3, Qwen 2), and merges whose results rank in merge order (tiktoken merges
by the rank of the merged token, HF by the merge's place in its list). Anything else, or
any text of ``probes`` on which the two disagree, keeps HF's encoder.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import tiktoken
from tokenizers import Tokenizer

log = logging.getLogger("switchyard.kvstore.bpe")

Encoder = Callable[[str], list[int]]

# The pre-split of GPT-2's ByteLevel pre-tokenizer (``use_regex``), as HF writes it.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Texts every fast encoder must agree on beside the caller's: what pre-splits differ on.
_CHECKS = (
    "Hello, world! It's 1999-12-31; we've 3.14 apples & 42 pears.",
    "  leading spaces\n\n\ttabs\r\nand CRLF   trailing   ",
    "Ünïcödé, 日本語のテキスト, emoji 🙂🚀 and ‘quotes’ — dashes…",
    "def f(x):\n    return x ** 2  # comment\n\nclass A:\n    pass\n",
    "URLs https://example.com/a?b=c&d=e, e-mail a.b@c.de, 1,000,000 and 0x1F",
    "I'LL they'D you'RE don't can't won't SHOULDN'T",
    "123456789 1 22 333 4444 55555 666666",
)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of a byte-level vocabulary to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _pattern(pre: dict[str, Any] | None) -> str | None:
    """The pre-split regex of a byte-level pre-tokenizer, or None if it is not one."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return _GPT2_PATTERN
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(split.get("pattern"), dict)
        or "Regex" not in split["pattern"]
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    return str(split["pattern"]["Regex"])


def _ranks(model: dict[str, Any]) -> dict[bytes, int] | None:
    """tiktoken's mergeable ranks (the ids), if merging by them is merging in list order."""
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    vocab: dict[str, int] = model["vocab"]
    decoder = _byte_decoder()
    try:
        ranks = {bytes(decoder[ch] for ch in token): i for token, i in vocab.items()}
    except KeyError:  # a token outside the byte alphabet: not a byte-level vocabulary
        return None
    last = -1
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None or merged <= last:
            return None
        last = merged
    return ranks


def fast_encoder(
    tokenizer: Tokenizer, split: re.Pattern[str] | None, probes: Iterable[str]
) -> Encoder | None:
    """An encoder giving ``tokenizer``'s ids without special tokens, or None where tiktoken
    cannot be shown to match it. ``split`` cuts the added tokens out of a text (they take
    their own ids): it must match every one of them."""
    config = json.loads(tokenizer.to_str())
    pattern = _pattern(config.get("pre_tokenizer"))
    ranks = _ranks(config.get("model") or {})
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    if config.get("normalizer") is not None or pattern is None or ranks is None:
        return None
    if specials and (split is None or any(split.fullmatch(s) is None for s in specials)):
        return None  # an added token the caller does not cut out would be BPE-encoded
    try:
        core = tiktoken.Encoding(
            "switchyard-routing", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except ValueError as exc:  # a pattern tiktoken's regex engine does not take
        log.info("tiktoken refused the tokenizer (%s): HF tokenizers encodes", exc)
        return None
    plain = core.encode_ordinary

    def encode(text: str) -> list[int]:
        if split is None:
            return plain(text)
        ids: list[int] = []
        for i, part in enumerate(split.split(text)):
            if i % 2:
                ids.append(specials[part])
            elif part:
                ids += plain(part)
        return ids

    for text in (*_CHECKS, *probes):
        if encode(text) != tokenizer.encode(text, add_special_tokens=False).ids:
            log.info("tiktoken differs from the tokenizer on a probe: HF tokenizers encodes")
            return None
    return encode
