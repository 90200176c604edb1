"""Engines that break mid-answer or hang: clean upstream errors, answers from elsewhere."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Worker, WorkerSpec
from switchyard.router.admission import STREAM, WHOLE, Expected, TTFTModel
from switchyard.router.forward import FirstByteDeadlines
from switchyard.router.request import CHAT, COMPLETIONS, RoutedRequest, parse
from switchyard.router.scheduler.framework import Context
from tests.router.inprocess import running_router
from tests.router.stub_backend import StubBackend
from tests.router.test_router_errors import assert_openai_error
from tests.support import metric

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "stub-model", "prompt": "hi", "max_tokens": 8}
ONE_TRY = {"router": {"retry": {"max_attempts": 1}}}
# Where a generation a worker may have begun must not run again elsewhere.
ONLY_EMBEDDINGS = {"router": {"retry": {"started_requests": "embeddings"}}}


async def test_stream_cut_midway_with_no_worker_to_resume_on_ends_with_an_upstream_error_event(
    engine: StubBackend,
) -> None:
    """With another worker the stream resumes there (``test_migration``); with none, or
    with migration off, it ends with an error event."""
    engine.state.chunk_interval_s = 0.001
    engine.state.cut_after_chunks = 3
    async with running_router(engine.url, config=ONE_TRY) as router:
        resp = await router.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[:3] == [b'data: {"i": %d}' % i for i in range(3)]
    assert events[-1].startswith(b"data: ")
    error = orjson.loads(events[-1][len(b"data: ") :])["error"]
    assert error["type"] == "server_error"
    assert error["code"] == "upstream_error"
    assert "Internal router error" not in resp.text


async def test_answer_cut_before_any_byte_was_sent_is_a_502(engine: StubBackend) -> None:
    engine.state.cut_after_chunks = 0
    async with running_router(engine.url, config=ONE_TRY) as router:
        resp = await router.post("/v1/completions", json=BODY)
    error = assert_openai_error(resp, 502)
    assert error["code"] == "upstream_error"


async def test_answer_cut_before_any_byte_was_sent_is_retried_elsewhere(
    engine: StubBackend, engine2: StubBackend
) -> None:
    engine.state.cut_after_chunks = 0
    async with running_router(engine.url, engine2.url, policy="round_robin") as router:
        statuses = [(await router.post("/v1/completions", json=BODY)).status_code for _ in range(4)]
    assert statuses == [200] * 4


async def test_answer_cut_before_any_byte_is_not_generated_again_where_the_setting_forbids(
    engine: StubBackend, engine2: StubBackend
) -> None:
    engine.state.cut_after_chunks = 0
    async with running_router(
        engine.url, engine2.url, config=ONLY_EMBEDDINGS, policy="round_robin"
    ) as router:
        statuses = [(await router.post("/v1/completions", json=BODY)).status_code for _ in range(4)]
    assert sorted(statuses) == [200, 200, 502, 502]
    assert engine.state.requests + engine2.state.requests == 4  # each generated once


async def test_hung_engine_requests_are_answered_elsewhere_and_it_is_taken_out(
    engine: StubBackend, engine2: StubBackend
) -> None:
    """A hung engine (accepts, never answers, /health passes) in a two-engine fleet, the
    default settings: every request is answered within 20 s, each abandoned attempt's
    connection is closed (so a real engine aborts it), and the engine stops getting
    traffic."""
    engine.state.hang = True
    engine2.state.chunk_interval_s = 0.001
    engine2.state.chunks = 3
    held_open = {
        "balancer": {"cb_open_timeout_s": 60},
        "router": {"timeouts": {"first_byte_base_s": 1.0}},
    }
    async with running_router(
        engine.url, engine2.url, config=held_open, policy="round_robin"
    ) as router:

        async def one(i: int) -> tuple[int, float]:
            began = time.monotonic()
            r = await router.post("/v1/completions", json={**BODY, "stream": i % 2 == 0})
            return r.status_code, time.monotonic() - began

        results = await asyncio.gather(*(one(i) for i in range(16)))
        assert [status for status, _ in results] == [200] * 16
        # The bound is the behaviour: first-byte deadlines move a request off the hung
        # engine long before the 600 s cap (20 s leaves room for a loaded machine).
        assert max(seconds for _, seconds in results) < 20
        metrics = (await router.get("/metrics")).text
        assert metric(metrics, "switchyard_router_worker_routable", worker=engine.url) == 0.0
        hung_saw = engine.state.requests
        assert len(engine.state.disconnected_at) == hung_saw > 0
        after = [await router.post("/v1/completions", json=BODY) for _ in range(4)]
    assert [r.status_code for r in after] == [200] * 4
    assert engine.state.requests == hung_saw


async def test_a_retried_answer_teaches_the_time_of_its_own_attempt_not_the_hung_ones(
    engine: StubBackend, engine2: StubBackend
) -> None:
    """The seconds spent on a hung first choice are not charged to the worker that then
    answers: charging them would inflate its learned rate, and with it every later
    first-byte deadline (a CI run once waited 116 s where 20 were allowed)."""
    engine.state.hang = True
    engine2.state.chunk_interval_s = 0.001
    engine2.state.chunks = 3
    # A 20 tokens/s prior predicts about 0.1 s for this prompt: the hung attempt's deadline
    # is about 2.4 s, so a ratio charged with it would be over 20; the answer's own is < 10.
    config = {
        "router": {
            "admission": {"prior_tokens_per_s": 20.0},
            "timeouts": {"first_byte_base_s": 2.0},
        }
    }
    async with running_router(
        engine.url, engine2.url, config=config, policy="round_robin"
    ) as router:
        r = await router.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-switchyard-worker"] == engine2.url
        metrics = (await router.get("/metrics")).text
    ratio = "switchyard_router_ttft_prediction_ratio"
    assert metric(metrics, ratio + "_count", kind="stream") == 1.0
    assert metric(metrics, ratio + "_sum", kind="stream") < 10.0


def _expected(predicted_s: float, *, stream: bool = True, learned: bool = False) -> Expected:
    model = TTFTModel(10_000.0)
    worker = Worker(WorkerSpec(url="http://127.0.0.1:1"), BalancerSettings())
    if learned:
        model.learn(worker.id, STREAM if stream else WHOLE, 0.001)
    expected = model.expect(Context(model="m", prompt_tokens=4), worker, stream)
    expected.predicted_s = predicted_s
    return expected


DEADLINES = FirstByteDeadlines(base_s=5.0, slack=4.0, output_token_allowance_s=0.25)


def _req(route: str = COMPLETIONS, **fields: object) -> RoutedRequest:
    prompt: dict[str, object] = (
        {"prompt": "hi"}
        if route == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    return parse(route, orjson.dumps({"model": "m", **prompt, **fields}), None)


def test_first_byte_deadline_grows_with_the_predicted_prefill() -> None:
    short = DEADLINES.of(_req(stream=True), _expected(0.1), 600.0)
    long = DEADLINES.of(_req(stream=True), _expected(30.0), 600.0)
    assert short == pytest.approx(5.4)
    assert long == pytest.approx(125.0)


def test_first_byte_deadline_never_exceeds_the_cap() -> None:
    assert DEADLINES.of(_req(stream=True), _expected(1000.0), 600.0) == 600.0


def test_non_streamed_answer_adds_its_output_allowance() -> None:
    deadline = DEADLINES.of(_req(max_tokens=100), _expected(0.1), 600.0)
    assert deadline == pytest.approx(5.4 + 25.0)


def test_non_streamed_completion_without_max_tokens_is_allowed_the_api_default_of_16() -> None:
    deadline = DEADLINES.of(_req(), _expected(0.1, stream=False), 600.0)
    assert deadline == pytest.approx(5.4 + 16 * 0.25)


def test_unbounded_chat_waits_for_the_cap_until_whole_answers_were_learned() -> None:
    assert DEADLINES.of(_req(CHAT), _expected(0.1, stream=False), 600.0) is None


def test_unbounded_chat_deadline_scales_the_learned_whole_answer_time() -> None:
    expected = _expected(2.0, stream=False, learned=True)
    deadline = DEADLINES.of(_req(CHAT), expected, 600.0)
    assert deadline == pytest.approx(5.0 + 4.0 * expected.spread * 2.0)


async def test_hung_engine_answers_a_completion_without_max_tokens_from_elsewhere(
    engine: StubBackend, engine2: StubBackend
) -> None:
    """Without max_tokens a completion has the API's default of 16, so its deadline is
    finite: a hung first choice is left for the next worker, not waited on for the cap."""
    engine.state.hang = True
    body = {"model": "stub-model", "prompt": "hi"}
    short = {
        "router": {
            "timeouts": {"first_byte_base_s": 0.5, "output_token_allowance_s": 0.01},
        }
    }
    async with running_router(engine.url, engine2.url, config=short, policy="round_robin") as r:
        results = [await r.post("/v1/completions", json=body) for _ in range(2)]
    assert [resp.status_code for resp in results] == [200, 200]
    assert {resp.headers["x-switchyard-worker"] for resp in results} == {engine2.url}
