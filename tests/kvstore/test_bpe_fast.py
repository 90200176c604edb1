"""tiktoken stands in for the HF tokenizer only where it gives the same ids."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from switchyard.kvstore.bpe import fast_encoder
from switchyard.kvstore.tokenize import RoutingTokenizer
from tests.support import TOKENIZER_DIR

SPECIALS = re.compile(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>)")
HF = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
OURS = fast_encoder(HF, SPECIALS, ())


def _config() -> dict[str, Any]:
    return json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())


def _variant(config: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(config))


def _hf_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_our_byte_level_tokenizer_gets_the_fast_encoder() -> None:
    assert OURS is not None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_the_fast_encoder_gives_the_tokenizers_ids_on_any_text(text: str) -> None:
    assert OURS is not None
    assert OURS(text) == _hf_ids(HF, text)


def test_special_tokens_inside_a_text_take_their_own_ids() -> None:
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert OURS is not None
    assert OURS(text) == _hf_ids(HF, text)
    assert HF.token_to_id("<|im_start|>") in OURS(text)


def test_a_routing_tokenizer_encodes_with_the_fast_encoder_where_it_is_exact() -> None:
    tok = RoutingTokenizer.from_dir(TOKENIZER_DIR)
    assert tok._fast is not None
    text = "A prompt long enough to be cut in pieces. " * 40
    assert tok.encode_prompt(text) == _hf_ids(HF, text)


def test_a_regex_split_then_byte_level_pre_tokenizer_is_taken_too() -> None:
    """The Llama 3 and Qwen 2 shape: the regex in a Split, ByteLevel without its own."""
    config = _config()
    gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    config["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": gpt2}, "behavior": "Isolated", "invert": False},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    tokenizer = _variant(config)
    fast = fast_encoder(tokenizer, SPECIALS, ())
    text = "It's 42 degrees,   isn't it?\n\n  Yes."
    assert fast is not None
    assert fast(text) == _hf_ids(tokenizer, text)


def test_a_tokenizer_with_a_normalizer_keeps_hf() -> None:
    config = _config()
    config["normalizer"] = {"type": "Lowercase"}
    assert fast_encoder(_variant(config), SPECIALS, ()) is None


def test_merges_out_of_rank_order_keep_hf() -> None:
    """tiktoken merges by the rank of the merged token: a list in another order differs."""
    config = _config()
    merges = config["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    assert fast_encoder(_variant(config), SPECIALS, ()) is None


def test_special_tokens_with_no_way_to_cut_them_out_keep_hf() -> None:
    assert fast_encoder(HF, None, ()) is None


def test_a_split_that_misses_an_added_token_keeps_hf() -> None:
    only_two = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")
    assert fast_encoder(HF, only_two, ()) is None


def test_a_pre_split_that_leaves_characters_unmatched_keeps_hf() -> None:
    """HF keeps the text between a Split's matches as pieces of its own; tiktoken drops it.
    The two read such a pattern apart, and the load-time probes see it."""
    config = _config()
    config["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": r"\p{L}+|\s"},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    tokenizer = _variant(config)
    assert fast_encoder(tokenizer, SPECIALS, ()) is None
