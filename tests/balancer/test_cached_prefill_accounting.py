"""A request whose prompt is mostly cached queues only its uncached prefill."""

from __future__ import annotations

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, WorkerSpec


def test_cached_prompt_queues_only_its_uncached_part_then_decodes_with_full_context() -> None:
    fleet = Fleet(BalancerSettings(), specs=[WorkerSpec(url="http://w:1")])
    worker = fleet.workers()[0]
    ticket = fleet.begin(worker, prompt_tokens=2000, prefill_tokens=64)
    assert worker.load().prefill_tokens == 64
    fleet.first_token(ticket)
    load = worker.load()
    assert (load.prefill_tokens, load.decode_tokens) == (0, 2000)
    fleet.end(ticket, Outcome.SUCCESS)
    assert (worker.load().prefill_tokens, worker.load().decode_tokens) == (0, 0)


def test_aborted_before_first_token_releases_the_queued_prefill() -> None:
    fleet = Fleet(BalancerSettings(), specs=[WorkerSpec(url="http://w:1")])
    worker = fleet.workers()[0]
    ticket = fleet.begin(worker, prompt_tokens=2000, prefill_tokens=500)
    fleet.end(ticket, Outcome.CLIENT_ABORT)
    assert worker.load().prefill_tokens == 0


def test_queued_tokens_are_the_loads_prefill_and_decode_parts() -> None:
    fleet = Fleet(BalancerSettings(), specs=[WorkerSpec(url="http://w:1")])
    worker = fleet.workers()[0]
    fleet.first_token(fleet.begin(worker, prompt_tokens=2000, prefill_tokens=64))
    fleet.begin(worker, prompt_tokens=300, prefill_tokens=300)
    load = worker.load()
    assert worker.queued_tokens() == (300, 2001)
    assert worker.queued_tokens() == (load.prefill_tokens, load.decode_tokens + load.decode_seqs)
