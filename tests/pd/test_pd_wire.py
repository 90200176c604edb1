"""The legs' bodies, field for field as vLLM's toy proxy and SGLang's mini_lb send them."""

from __future__ import annotations

import orjson

from switchyard.router.pd import wire

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 50,
    "max_completion_tokens": 50,
}


def test_vllm_prefill_leg_asks_for_one_unstreamed_token_and_a_remote_decode() -> None:
    body = orjson.loads(wire.vllm_prefill(CHAT))
    assert body["stream"] is False
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert "stream_options" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["messages"] == CHAT["messages"]


def test_vllm_prefill_leg_does_not_invent_max_completion_tokens() -> None:
    body = orjson.loads(wire.vllm_prefill({"model": "m", "prompt": "x", "max_tokens": 9}))
    assert "max_completion_tokens" not in body


def test_vllm_decode_leg_is_the_original_body_plus_the_prefill_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 9}
    body = orjson.loads(wire.vllm_decode(CHAT, params))
    assert body == {**CHAT, "kv_transfer_params": params}


def test_sglang_legs_carry_host_port_and_a_63_bit_room() -> None:
    body = orjson.loads(wire.sglang_bootstrap(CHAT, "10.0.0.5", 8998))
    assert body["bootstrap_host"] == "10.0.0.5"
    assert body["bootstrap_port"] == 8998
    assert 0 <= body["bootstrap_room"] < 2**63
    assert body["stream"] is True and body["max_tokens"] == 50


def test_sglang_rooms_are_fresh_per_request() -> None:
    rooms = {orjson.loads(wire.sglang_bootstrap(CHAT, "h", 1))["bootstrap_room"] for _ in range(50)}
    assert len(rooms) == 50


def test_sglang_batch_gets_one_room_per_item() -> None:
    body = orjson.loads(wire.sglang_bootstrap({"model": "m", "prompt": ["a", "b", "c"]}, "h", 7))
    assert body["bootstrap_host"] == ["h", "h", "h"]
    assert body["bootstrap_port"] == [7, 7, 7]
    assert len(set(body["bootstrap_room"])) == 3


def test_a_token_id_prompt_is_one_item_not_a_batch() -> None:
    body = orjson.loads(wire.sglang_bootstrap({"model": "m", "prompt": [1, 2, 3]}, "h", 7))
    assert isinstance(body["bootstrap_room"], int)


def test_bootstrap_host_brackets_ipv6() -> None:
    assert wire.bootstrap_host("http://[fd00::1]:30000") == "[fd00::1]"
    assert wire.bootstrap_host("http://prefill-0.svc:30000") == "prefill-0.svc"


def test_image_refs_finds_image_parts_in_order() -> None:
    data = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "a.png"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": "b.png"}},
                ],
            },
        ]
    }
    assert wire.image_refs(data) == ["a.png", "b.png"]
    assert wire.image_refs(CHAT) == []
