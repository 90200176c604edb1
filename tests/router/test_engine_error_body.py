"""Engine errors reach clients with ``code`` typed as OpenAI types it (string or null)."""

from __future__ import annotations

import orjson

from switchyard.router.errors import engine_error_body

VLLM_400 = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def test_vllms_numeric_code_becomes_a_string() -> None:
    out = orjson.loads(engine_error_body(orjson.dumps(VLLM_400)))
    assert out["error"]["code"] == "400"
    assert out["error"]["message"] == VLLM_400["error"]["message"]


def test_a_string_or_null_code_passes_unchanged() -> None:
    for code in ("context_length_exceeded", None):
        body = orjson.dumps({"error": {**VLLM_400["error"], "code": code}})
        assert engine_error_body(body) == body


def test_a_body_that_is_not_an_error_object_passes_unchanged() -> None:
    for body in (b"not json", b"[1, 2]", b'{"detail": "Not Found"}'):
        assert engine_error_body(body) == body
