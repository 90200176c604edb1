"""What the router says on stderr when it starts: where, which workers, policy, KV mode, Redis."""

from __future__ import annotations

from switchyard.router.server import startup_summary
from switchyard.router.settings import RouterSettings


def summary(**flags: object) -> str:
    return "\n".join(startup_summary(RouterSettings.load(None, **flags)))


def test_names_the_listening_url_and_the_policy() -> None:
    text = summary(host="127.0.0.1", port=8123, policy="least_load")
    assert "listening on http://127.0.0.1:8123" in text and "policy: least_load" in text


def test_counts_workers_by_flavour_and_role() -> None:
    text = summary(
        workers=["http://127.0.0.1:1", "http://127.0.0.1:2;flavor=sglang"],
        pd={"prefill": ["http://127.0.0.1:3"]},
    )
    assert "workers: 3 (1 prefill, 1 sglang unified, 1 unified)" in text


def test_kv_mode_is_events_when_workers_publish_them() -> None:
    text = summary(
        workers=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        kv={"events": ["http://127.0.0.1:1=tcp://127.0.0.1:5557"], "block_size": 32},
    )
    assert "kv: events from 1 of 2 workers" in text and "block size 32" in text


def test_kv_mode_is_approximate_without_events() -> None:
    assert "kv: approximate" in summary(workers=["http://127.0.0.1:1"], policy="kv_aware")


def test_kv_mode_is_off_for_a_policy_without_prefixes() -> None:
    assert "kv: off" in summary(policy="round_robin")


def test_says_whether_state_is_shared_through_redis() -> None:
    assert "redis: redis://127.0.0.1:6379/0" in summary(redis_url="redis://127.0.0.1:6379/0")
    assert "redis: no" in summary()
