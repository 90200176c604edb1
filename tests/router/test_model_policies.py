"""A model may be routed by a policy of its own (``--model-policy MODEL=POLICY``), beside
the router's default for the others."""

from __future__ import annotations

import pytest

from switchyard.mock.settings import MockSettings
from switchyard.router.server import preflight
from switchyard.router.settings import RouterSettings
from tests.router.inprocess import running_router
from tests.router.mock_engines import mock_engines

pytestmark = pytest.mark.timeout(60)


def engine(model: str) -> MockSettings:
    return MockSettings(model=model, speed=100.0)


def decisions(text: str, policy: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("switchyard_router_routing_decisions_total{") and (
            f'policy="{policy}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_each_model_is_routed_by_its_own_policy_or_the_default() -> None:
    async with mock_engines(engine("chat"), engine("chat"), engine("embed")) as engines:
        urls = [e.url for e in engines]
        async with running_router(*urls, model_policies=["chat=round_robin"]) as router:
            assert router.app.scheduler_for("chat").policy == "round_robin"
            assert router.app.scheduler_for("embed").policy == "kv_aware"
            for n in range(4):
                body = {"model": "chat", "prompt": f"same words {n}", "max_tokens": 2}
                answer = await router.post("/v1/completions", json=body)
                assert answer.status_code == 200
            body = {"model": "embed", "prompt": "hello", "max_tokens": 2}
            assert (await router.post("/v1/completions", json=body)).status_code == 200
            text = (await router.get("/metrics")).text
    assert decisions(text, "round_robin") == 4
    assert decisions(text, "kv_aware") == 1


def test_a_model_policy_that_does_not_exist_stops_start_up_in_one_line() -> None:
    settings = RouterSettings(workers=["http://127.0.0.1:1"], model_policies=["chat=fastest"])
    with pytest.raises(ValueError, match="--model-policy chat=fastest: unknown policy"):
        preflight(settings)


def test_model_policies_read_as_a_mapping_and_refuse_a_model_twice() -> None:
    settings = RouterSettings(model_policies={"chat": "least_load"})  # type: ignore[arg-type]
    assert settings.policies == {"chat": "least_load"}
    with pytest.raises(ValueError, match="given twice"):
        RouterSettings(model_policies=["a=round_robin", "a=random"])
    with pytest.raises(ValueError, match="expected MODEL=POLICY"):
        RouterSettings(model_policies=["round_robin"])
