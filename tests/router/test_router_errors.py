"""Every error the router answers itself has the documented status and the OpenAI shape.

The router app runs in-process (``tests.router.inprocess``) in front of a stub worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.router.inprocess import InProcessRouter, running_router
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
async def router(engine: StubBackend) -> AsyncIterator[InProcessRouter]:
    async with running_router(
        engine.url, config={"router": {"limits": {"max_body_bytes": 4096}}}
    ) as r:
        yield r


async def test_malformed_json_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", content=b'{"model": ')
    assert_openai_error(resp, 400)


async def test_body_that_is_not_an_object_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json=["model"])
    assert_openai_error(resp, 400)


async def test_missing_model_is_400_naming_the_param(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"prompt": "hi"})
    assert_openai_error(resp, 400, param="model")


async def test_non_string_model_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"model": 7, "prompt": "hi"})
    assert_openai_error(resp, 400, param="model")


async def test_missing_prompt_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"model": "stub-model"})
    assert_openai_error(resp, 400, param="prompt")


async def test_invalid_prompt_type_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"model": "stub-model", "prompt": {"a": 1}})
    assert_openai_error(resp, 400, param="prompt")


async def test_missing_messages_is_400(router: InProcessRouter) -> None:
    resp = await router.post("/v1/chat/completions", json={"model": "stub-model"})
    assert_openai_error(resp, 400, param="messages")


async def test_messages_without_role_is_400(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "messages": [{"content": "hi"}]}
    resp = await router.post("/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


async def test_content_part_whose_text_is_not_a_string_is_400(router: InProcessRouter) -> None:
    part = {"type": "text", "text": ["not", "a", "string"]}
    body = {"model": "stub-model", "messages": [{"role": "user", "content": [part]}]}
    resp = await router.post("/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


async def test_content_part_that_is_not_an_object_is_400(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": ["hi"]}]}
    resp = await router.post("/v1/chat/completions", json=body)
    assert_openai_error(resp, 400, param="messages")


async def test_image_part_without_text_is_accepted(router: InProcessRouter) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "what is this?"}
    body = {"model": "stub-model", "messages": [{"role": "user", "content": [image, text]}]}
    resp = await router.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text


async def test_non_boolean_stream_is_400(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "prompt": "hi", "stream": "yes"}
    assert_openai_error(await router.post("/v1/completions", json=body), 400, param="stream")


async def test_unknown_model_is_404(router: InProcessRouter) -> None:
    resp = await router.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    error = assert_openai_error(resp, 404, param="model")
    assert error["code"] == "model_not_found"


async def test_body_over_the_limit_is_413(router: InProcessRouter) -> None:
    body = {"model": "stub-model", "prompt": "x" * 5000}
    assert_openai_error(await router.post("/v1/completions", json=body), 413)


async def test_get_on_an_inference_route_is_405(router: InProcessRouter) -> None:
    assert_openai_error(await router.get("/v1/completions"), 405)


async def test_unknown_path_is_404_in_openai_shape(router: InProcessRouter) -> None:
    assert_openai_error(await router.get("/v2/nothing"), 404)


async def test_no_worker_at_all_is_503_with_retry_after() -> None:
    async with running_router() as router:
        resp = await router.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert_openai_error(resp, 503)
    assert int(resp.headers["retry-after"]) >= 1


async def test_unreachable_worker_is_502_after_retries(engine: StubBackend) -> None:
    no_probes = {"balancer": {"probe_interval_s": 60, "cb_failure_threshold": 1000}}
    body = {"model": "stub-model", "prompt": "hi"}
    async with running_router(engine.url, config=no_probes) as router:
        assert (await router.post("/v1/completions", json=body)).status_code == 200
        await engine.close()
        resp = await router.post("/v1/completions", json=body)
    error = assert_openai_error(resp, 502)
    assert error["code"] == "upstream_unreachable"


async def test_worker_that_never_answers_is_504(engine: StubBackend) -> None:
    engine.state.hang = True
    config = {"router": {"timeouts": {"first_byte_s": 0.5}}}
    async with running_router(engine.url, config=config) as r:
        resp = await r.post("/v1/completions", json={"model": "stub-model", "prompt": "hi"})
    error = assert_openai_error(resp, 504)
    assert error["code"] == "upstream_timeout"


async def test_missing_api_key_is_401(engine: StubBackend) -> None:
    body = {"model": "stub-model", "prompt": "hi"}
    async with running_router(engine.url, api_key="sekret") as router:
        assert_openai_error(await router.post("/v1/completions", json=body), 401)
        ok = await router.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}
        )
    assert ok.status_code == 200
    assert "authorization" not in {k.lower() for k in engine.state.last_headers}


async def test_admin_api_requires_the_admin_key(engine: StubBackend) -> None:
    async with running_router(engine.url, admin_api_key="adm") as router:
        assert_openai_error(await router.get("/admin/workers"), 401)
        ok = await router.get("/admin/workers", headers={"Authorization": "Bearer adm"})
    assert [w["url"] for w in ok.json()["workers"]] == [engine.url]
