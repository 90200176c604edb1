"""The flow-control queue: strict bands, VTC fair share between tenants, FCFS or EDF within
a tenant, caps, TTL, clients gone, per-model capacity and drain. Driven by a fake clock."""

from __future__ import annotations

import pytest

from switchyard.router.flow.identity import Identity
from switchyard.router.flow.queue import FlowQueue, Queued, QueueLimits, Refused


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **limits: object) -> FlowQueue:
    return FlowQueue(QueueLimits(**limits), clock)  # type: ignore[arg-type]


def req(
    clock: Clock,
    tenant: str = "t",
    priority: int = 0,
    *,
    model: str = "m",
    size: int = 100,
    prompt: int = 100,
    deadline_ms: float | None = None,
    name: str = "",
) -> Queued:
    return Queued(
        Identity(tenant, priority, deadline_ms), model, size, prompt, clock.now, payload=name
    )


def serve(queue: FlowQueue, count: int, output: int = 0) -> list[str]:
    """Pop ``count`` requests, charging each as answered; the tenants in dispatch order."""
    served = []
    for _ in range(count):
        item = queue.pop()
        assert item is not None
        queue.charge(item.identity.tenant, item.prompt_tokens, output)
        served.append(item.identity.tenant)
    return served


# -- bands --------------------------------------------------------------------------------


def test_higher_bands_go_first_whatever_the_counters(clock: Clock) -> None:
    queue = make(clock)
    queue.charge("rich", 10**9, 10**9)
    for name, priority in [("n1", 0), ("l1", -1), ("h1", 1), ("n2", 0), ("x", 7), ("h2", 1)]:
        queue.push(req(clock, "rich" if priority > 0 else "poor", priority, name=name))
    order = [queue.pop() for _ in range(6)]
    assert [i.payload for i in order if i] == ["x", "h1", "h2", "n1", "n2", "l1"]
    assert queue.pop() is None
    assert queue.size == 0


# -- fair share (VTC) ---------------------------------------------------------------------


def test_a_light_tenant_is_not_stuck_behind_a_heavy_ones_backlog(clock: Clock) -> None:
    queue = make(clock)
    for _ in range(20):
        queue.push(req(clock, "heavy"))
    queue.push(req(clock, "light"))
    queue.push(req(clock, "light"))
    assert serve(queue, 6, output=10) == ["heavy", "light", "heavy", "light", "heavy", "heavy"]
    assert queue.size == 16


def test_dispatch_alternates_even_before_any_answer_is_charged(clock: Clock) -> None:
    queue = make(clock)
    for _ in range(4):
        queue.push(req(clock, "a"))
        queue.push(req(clock, "b"))
    tenants = [item.identity.tenant for item in iter(queue.pop, None)]
    assert tenants == ["a", "b"] * 4


def test_the_tenant_served_less_goes_first_until_it_catches_up(clock: Clock) -> None:
    queue = make(clock, half_life_s=0)
    queue.push(req(clock, "light"))  # queued first, so not lifted
    queue.charge("heavy", 300, 0)  # served on the fast path before the queue formed
    for _ in range(3):
        queue.push(req(clock, "light"))
        queue.push(req(clock, "heavy"))
    assert serve(queue, 4) == ["light", "light", "light", "heavy"]


def test_output_tokens_cost_output_weight_prompt_tokens(clock: Clock) -> None:
    queue = make(clock, output_weight=3.0, half_life_s=0)
    queue.charge("t", 100, 10)
    assert queue.counter("t") == 130
    assert queue.counter("never-seen") == 0


def test_the_prompt_advanced_at_dispatch_is_not_charged_twice(clock: Clock) -> None:
    queue = make(clock, half_life_s=0)
    queue.push(req(clock, "t", prompt=100))
    queue.pop()
    assert queue.counter("t") == 100
    queue.charge("t", 100, 10)
    assert queue.counter("t") == 120
    queue.charge("t", 100, 0)  # a request that never queued pays in full
    assert queue.counter("t") == 220


def test_a_tenant_back_from_idle_is_lifted_and_gets_no_burst(clock: Clock) -> None:
    queue = make(clock, half_life_s=0)
    for _ in range(30):
        queue.push(req(clock, "steady"))
    serve(queue, 10, output=50)
    assert queue.counter("steady") == 2000
    queue.push(req(clock, "returning"))
    queue.push(req(clock, "returning"))
    queue.push(req(clock, "returning"))
    assert queue.counter("returning") == queue.counter("steady")
    assert serve(queue, 6) == ["steady", "returning"] * 3


def test_a_tenant_joining_an_empty_queue_is_lifted_to_the_last_served(clock: Clock) -> None:
    queue = make(clock, half_life_s=0)
    queue.push(req(clock, "a"))
    serve(queue, 1, output=200)
    assert queue.counter("a") == 500
    queue.push(req(clock, "b"))
    assert queue.counter("b") == 500


def test_lifting_never_lowers_a_counter(clock: Clock) -> None:
    queue = make(clock, half_life_s=0)
    queue.push(req(clock, "a"))
    queue.charge("b", 1000, 0)
    queue.push(req(clock, "b"))
    assert queue.counter("b") == 1000


def test_a_counter_halves_every_half_life(clock: Clock) -> None:
    queue = make(clock, half_life_s=60)
    queue.charge("t", 1000, 0)
    clock.now = 60.0
    assert queue.counter("t") == pytest.approx(500)
    clock.now = 120.0
    assert queue.counter("t") == pytest.approx(250)
    queue.charge("t", 250, 0)
    assert queue.counter("t") == pytest.approx(500)


def test_counters_and_order_survive_a_long_run(clock: Clock) -> None:
    queue = make(clock, half_life_s=1.0)
    queue.push(req(clock, "waiting", prompt=0))
    for step in range(1, 101):  # well past the point where stored units are rescaled
        clock.now = float(step)
        queue.charge("busy", 1000, 0)
        if step == 1:
            queue.charge("once", 10, 0)
    assert queue.counter("busy") == pytest.approx(2000, rel=1e-6)
    assert queue.counter("once") == 0  # decayed to nothing and forgotten
    queue.push(req(clock, "busy", name="busy"))
    queue.push(req(clock, "waiting", name="late"))
    assert [queue.pop().payload for _ in range(3)] == ["", "late", "busy"]  # type: ignore[union-attr]


# -- within a tenant ------------------------------------------------------------------------


def test_fcfs_within_a_tenant_ignores_deadlines(clock: Clock) -> None:
    queue = make(clock, ordering="fcfs")
    for name, deadline in [("first", 5000.0), ("second", 100.0), ("third", None)]:
        queue.push(req(clock, deadline_ms=deadline, name=name))
        clock.now += 1
    assert [i.payload for i in iter(queue.pop, None)] == ["first", "second", "third"]


def test_edf_within_a_tenant_takes_the_earliest_deadline(clock: Clock) -> None:
    queue = make(clock, ordering="edf", ttl_s=30)
    queue.push(req(clock, deadline_ms=None, name="due-at-ttl"))  # due at 30 s
    queue.push(req(clock, deadline_ms=5000, name="due-at-5s"))
    clock.now = 3.0
    queue.push(req(clock, deadline_ms=1000, name="due-at-4s"))
    queue.push(req(clock, deadline_ms=60_000, name="due-at-63s"))
    got = [i.payload for i in iter(queue.pop, None)]
    assert got == ["due-at-4s", "due-at-5s", "due-at-ttl", "due-at-63s"]


def test_edf_orders_within_a_tenant_not_across_tenants(clock: Clock) -> None:
    queue = make(clock, ordering="edf")
    queue.push(req(clock, "a", deadline_ms=10_000, name="a-late"))
    queue.push(req(clock, "b", deadline_ms=10, name="b-urgent"))
    queue.push(req(clock, "a", deadline_ms=5, name="a-urgent"))
    assert [i.payload for i in iter(queue.pop, None)] == ["a-urgent", "b-urgent", "a-late"]


def test_a_bad_ordering_is_refused() -> None:
    with pytest.raises(ValueError, match="ordering"):
        QueueLimits(ordering="lifo")  # type: ignore[arg-type]


# -- caps, TTL, clients gone ----------------------------------------------------------------


def test_the_request_cap_is_per_band(clock: Clock) -> None:
    queue = make(clock, max_requests_per_band=2, ttl_s=30)
    queue.push(req(clock, "a"))
    clock.now = 5.0
    queue.push(req(clock, "b"))
    with pytest.raises(Refused) as refused:
        queue.push(req(clock, "c"))
    assert refused.value.reason == "queue_full"
    assert refused.value.retry_after_s == 5.0  # the oldest has waited this long
    queue.push(req(clock, "c", priority=1))
    assert queue.size == 3


def test_the_byte_cap_is_per_band(clock: Clock) -> None:
    queue = make(clock, max_bytes_per_band=1000)
    queue.push(req(clock, size=600))
    with pytest.raises(Refused) as refused:
        queue.push(req(clock, size=500))
    assert refused.value.reason == "queue_bytes_full"
    assert refused.value.retry_after_s == 1.0
    queue.push(req(clock, size=400))
    queue.push(req(clock, priority=-1, size=900))
    queue.pop()
    queue.push(req(clock, size=600))  # room again once one has left
    assert queue.size == 3


def test_retry_after_stays_within_one_second_and_the_ttl(clock: Clock) -> None:
    queue = make(clock, max_requests_per_band=1, ttl_s=10)
    queue.push(req(clock))
    clock.now = 500.0
    with pytest.raises(Refused) as refused:
        queue.push(req(clock))
    assert refused.value.retry_after_s == 10.0


def test_a_cap_of_zero_is_no_cap(clock: Clock) -> None:
    queue = make(clock, max_requests_per_band=0, max_bytes_per_band=0)
    for _ in range(50):
        queue.push(req(clock, size=10**9))
    assert queue.size == 50


def test_requests_expire_after_the_ttl_and_are_never_dispatched(clock: Clock) -> None:
    queue = make(clock, ttl_s=30)
    queue.push(req(clock, "a", name="old"))
    clock.now = 10.0
    queue.push(req(clock, "b", priority=1, name="young"))
    clock.now = 29.9
    assert queue.expire() == []
    clock.now = 30.0
    assert [i.payload for i in queue.expire()] == ["old"]
    assert queue.size == 1
    assert queue.sizes() == {(1, "b"): 1}
    clock.now = 40.0
    expired = queue.expire()
    assert [i.payload for i in expired] == ["young"]
    assert not expired[0].queued
    assert queue.pop() is None


def test_no_ttl_means_nothing_expires(clock: Clock) -> None:
    queue = make(clock, ttl_s=0)
    queue.push(req(clock))
    clock.now = 10**6
    assert queue.expire() == []
    assert queue.size == 1


def test_a_removed_request_is_never_dispatched(clock: Clock) -> None:
    queue = make(clock)
    gone = req(clock, "a", name="gone")
    queue.push(gone)
    queue.push(req(clock, "a", name="stays"))
    assert queue.remove(gone)
    assert not queue.remove(gone)
    assert queue.size == 1
    assert queue.sizes() == {(0, "a"): 1}
    assert [i.payload for i in iter(queue.pop, None)] == ["stays"]
    assert not queue.remove(gone)


def test_a_request_cannot_be_queued_twice(clock: Clock) -> None:
    queue = make(clock)
    item = req(clock)
    queue.push(item)
    with pytest.raises(ValueError, match="already queued"):
        queue.push(item)


def test_many_removals_leave_the_queue_consistent(clock: Clock) -> None:
    queue = make(clock)
    items = [req(clock, f"t{i % 5}", model=f"m{i % 3}", name=str(i)) for i in range(400)]
    for item in items:
        queue.push(item)
    for item in items[::2]:
        assert queue.remove(item)
    popped = [i.payload for i in iter(queue.pop, None)]
    assert sorted(popped, key=int) == [str(i) for i in range(1, 400, 2)]
    assert queue.size == 0


# -- per-model capacity ------------------------------------------------------------------


def test_a_model_without_capacity_does_not_block_another(clock: Clock) -> None:
    queue = make(clock)
    queue.push(req(clock, "a", model="big", name="a-big"))
    queue.push(req(clock, "a", model="small", name="a-small"))
    queue.push(req(clock, "b", model="big", name="b-big"))
    asked: list[str] = []

    def only_small(model: str, prompt_tokens: int) -> bool:
        asked.append(model)
        return model == "small"

    first = queue.pop(only_small)
    assert first is not None and first.payload == "a-small"
    assert sorted(asked) == ["big", "small"]  # each model asked once per pop
    asked.clear()
    assert queue.pop(only_small) is None
    assert asked == ["big"]
    assert [i.payload for i in iter(queue.pop, None)] == ["b-big", "a-big"]


def test_a_lower_band_goes_when_the_higher_bands_model_is_full(clock: Clock) -> None:
    queue = make(clock)
    queue.push(req(clock, priority=1, model="busy", name="high"))
    queue.push(req(clock, priority=0, model="free", name="normal"))
    item = queue.pop(lambda model, _: model == "free")
    assert item is not None and item.payload == "normal"
    assert queue.sizes() == {(1, "t"): 1}


def test_a_long_prompt_without_room_does_not_block_a_short_one(clock: Clock) -> None:
    """Room is judged per request: a tenant's long prompt waits for a drained worker while
    another tenant's short one, which fits beside the queued prefill, goes."""
    queue = make(clock)
    queue.push(req(clock, "flood", prompt=2000, name="long"))
    queue.push(req(clock, "quiet", prompt=100, name="short"))
    asked: list[int] = []

    def room_for_500(model: str, prompt_tokens: int) -> bool:
        asked.append(prompt_tokens)
        return prompt_tokens <= 500

    item = queue.pop(room_for_500)
    assert item is not None and item.payload == "short"
    assert sorted(asked) == [100, 2000]
    assert queue.pop(room_for_500) is None
    assert queue.pop(lambda model, prompt_tokens: True).payload == "long"  # type: ignore[union-attr]


# -- views and shutdown ----------------------------------------------------------------------


def test_sizes_count_by_band_and_tenant(clock: Clock) -> None:
    queue = make(clock)
    for tenant, priority in [("a", 0), ("a", 0), ("b", 0), ("a", 1), ("c", -1)]:
        queue.push(req(clock, tenant, priority))
    assert queue.sizes() == {(0, "a"): 2, (0, "b"): 1, (1, "a"): 1, (-1, "c"): 1}


def test_tokens_ahead_count_the_tenants_order_and_the_others_equal_turns(clock: Clock) -> None:
    queue = make(clock)
    first, second = req(clock, "flood", prompt=1000), req(clock, "flood", prompt=1000)
    for item in (first, second, req(clock, "quiet", prompt=30), req(clock, "vip", 1, prompt=5)):
        queue.push(item)
    # the higher band's 5, then the flood's own and the quiet tenant's 30 in turn
    assert queue.tokens_ahead_of(first) == 5 + 1000 + 30
    assert queue.tokens_ahead_of(second) == 5 + 2000 + 30
    assert queue.tokens_ahead(Identity("quiet", 0), 30) == 5 + 60 + 60
    assert queue.tokens_ahead(Identity("vip", 1), 5) == 10
    assert queue.pop() is not None  # the vip's
    assert queue.pop() is first  # the counters level, the flood came first
    assert queue.tokens_ahead_of(second) == 1000 + 30
    assert queue.tokens_ahead(Identity("other", 0), 0) == 1 + 1 + 1  # a turn each


def test_drain_hands_back_everything_and_empties_the_queue(clock: Clock) -> None:
    queue = make(clock)
    for name, priority in [("n1", 0), ("h1", 1), ("l1", -1), ("n2", 0)]:
        queue.push(req(clock, priority=priority, name=name))
    drained = queue.drain()
    assert [i.payload for i in drained] == ["h1", "n1", "n2", "l1"]
    assert not any(i.queued for i in drained)
    assert queue.size == 0 and queue.sizes() == {} and queue.pop() is None
    assert not queue.remove(drained[0])
    queue.push(req(clock, name="after"))
    assert queue.pop().payload == "after"  # type: ignore[union-attr]
