"""Which worker each attempt of a request goes to: the policy's order, but never back to a
worker whose first byte was late while another may still answer."""

from __future__ import annotations

from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Worker, WorkerSpec
from switchyard.router.forward import next_worker


def workers(n: int) -> list[Worker]:
    settings = BalancerSettings()
    return [Worker(WorkerSpec(f"http://127.0.0.1:{9000 + i}"), settings) for i in range(n)]


def test_attempts_follow_the_policys_order_in_turn() -> None:
    ranked = workers(3)
    assert [next_worker(ranked, a, []) for a in range(4)] == [*ranked, ranked[0]]


def test_a_worker_whose_first_byte_was_late_is_skipped() -> None:
    a, _, c = ranked = workers(3)
    assert next_worker(ranked, 2, [c]) is a


def test_when_every_worker_was_late_the_most_recent_one_is_tried_again() -> None:
    hung, loaded = ranked = workers(2)
    assert next_worker(ranked, 2, [hung, loaded]) is loaded
