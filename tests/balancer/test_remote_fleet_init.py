"""A RemoteFleet built with static workers in its settings queues them for the service."""

from __future__ import annotations

from switchyard.balancer.remote import RemoteFleet
from switchyard.balancer.settings import BalancerSettings


def test_static_workers_in_settings_are_known_and_queued_before_start() -> None:
    fleet = RemoteFleet("http://127.0.0.1:1", settings=BalancerSettings(workers=["http://w:1"]))
    assert [w.id for w in fleet.workers()] == ["http://w:1"]
    assert [call[1] for call in fleet._queued] == ["/admin/workers"]
