"""Every error the router answers itself has the documented status and the OpenAI shape."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import StartRouter
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(60)

OPENAI_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
}


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["type"] in OPENAI_ERROR_TYPES
    return error


@pytest.fixture
def router(stub: StubBackend, start_router: StartRouter) -> str:
    return start_router(stub.url, config={"router": {"max_body_bytes": 4096}}).url


def test_malformed_json_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", content=b'{"model": ')
    assert_openai_error(resp, 400)


def test_body_that_is_not_an_object_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json=["model"])
    assert_openai_error(resp, 400)


def test_missing_model_is_400_naming_the_param(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"prompt": "hi"})
    assert_openai_error(resp, 400, param="model")


def test_non_string_model_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"model": 7, "prompt": "hi"})
    assert_openai_error(resp, 400, param="model")


def test_missing_prompt_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"model": "stub-model"})
    assert_openai_error(resp, 400, param="prompt")


def test_invalid_prompt_type_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"model": "stub-model", "prompt": {"a": 1}})
    assert_openai_error(resp, 400, param="prompt")


def test_missing_messages_is_400(router: str) -> None:
    resp = httpx.post(router + "/v1/chat/completions", json={"model": "stub-model"})
    assert_openai_error(resp, 400, param="messages")


def test_messages_without_role_is_400(router: str) -> None:
    body = {"model": "stub-model", "messages": [{"content": "hi"}]}
    resp = httpx.post(router + "/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


def test_content_part_whose_text_is_not_a_string_is_400(router: str) -> None:
    part = {"type": "text", "text": ["not", "a", "string"]}
    body = {"model": "stub-model", "messages": [{"role": "user", "content": [part]}]}
    resp = httpx.post(router + "/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


def test_content_part_that_is_not_an_object_is_400(router: str) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": ["hi"]}]}
    resp = httpx.post(router + "/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


def test_image_part_without_text_is_accepted(router: str) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "what is this?"}
    body = {"model": "stub-model", "messages": [{"role": "user", "content": [image, text]}]}
    resp = httpx.post(router + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


def test_non_boolean_stream_is_400(router: str) -> None:
    body = {"model": "stub-model", "prompt": "hi", "stream": "yes"}
    assert_openai_error(httpx.post(router + "/v1/completions", json=body), 400, param="stream")


def test_unknown_model_is_404(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    error = assert_openai_error(resp, 404, param="model")
    assert error["code"] == "model_not_found"


def test_body_over_the_limit_is_413(router: str) -> None:
    body = {"model": "stub-model", "prompt": "x" * 5000}
    assert_openai_error(httpx.post(router + "/v1/completions", json=body), 413)


def test_get_on_an_inference_route_is_405(router: str) -> None:
    assert_openai_error(httpx.get(router + "/v1/completions"), 405)


def test_unknown_path_is_404_in_openai_shape(router: str) -> None:
    assert_openai_error(httpx.get(router + "/v2/nothing"), 404)


def test_no_worker_at_all_is_503_with_retry_after(start_router: StartRouter) -> None:
    router = start_router().url
    resp = httpx.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert_openai_error(resp, 503)
    assert int(resp.headers["retry-after"]) >= 1


def test_unreachable_worker_is_502_after_retries(
    stub: StubBackend, start_router: StartRouter
) -> None:
    no_probes = {"balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000}}
    router = start_router(stub.url, config=no_probes).url
    assert httpx.post(router + "/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    stub.stop()
    resp = httpx.post(router + "/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    error = assert_openai_error(resp, 502)
    assert error["code"] == "upstream_unreachable"


def test_worker_that_never_answers_is_504(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url, config={"router": {"first_byte_timeout_s": 0.5}}).url
    stub.state.hang = True
    resp = httpx.post(router + "/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    error = assert_openai_error(resp, 504)
    assert error["code"] == "upstream_timeout"


def test_missing_api_key_is_401(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url, args=("--api-key", "sekret")).url
    resp = httpx.post(router + "/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    assert_openai_error(resp, 401)
    ok = httpx.post(
        router + "/v1/completions",
        json={"model": "stub-model", "prompt": "hi"},
        headers={"Authorization": "Bearer sekret"},
    )
    assert ok.status_code == 200
    assert "authorization" not in {k.lower() for k in stub.state.last_headers}


def test_admin_api_requires_the_admin_key(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url, args=("--admin-api-key", "adm")).url
    assert_openai_error(httpx.get(router + "/admin/workers"), 401)
    ok = httpx.get(router + "/admin/workers", headers={"Authorization": "Bearer adm"})
    assert [w["url"] for w in ok.json()["workers"]] == [stub.url]
