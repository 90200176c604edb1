"""Is a worker saturated: should a new request wait in the router rather than go to it?

A request queued on a saturated engine gains nothing and loses the router's choices (band,
fair share, deadline, a worker that frees up first), so the router holds it instead. The
engine's own view (waiting requests, KV usage, scraped) is the main signal; the router's
counters (in flight, prefill tokens not yet computed) add caps an operator can set.

The prefill cap counts the new request's own prompt: a worker with prefill queued takes
one more only while both fit under the cap (one with none takes any), so a long prompt
waits for a worker that has drained while a short one still fits beside the queued work:
the engine's next step then holds it, rather than the step after a second long prompt.
The whole prompt is counted, as what the chosen worker has cached is known only once it
is chosen; that errs toward waiting.

A short prompt (an eighth of the cap at most) that fits in what is left of the last step
of a worker's queued prefill, in steps of the cap (which an operator sets at the engines'
step budget), adds no step to it and barely lengthens the one it joins: a prompt of two
steps leaves its second step part empty, and a short request put there has its first
token with that prompt's, not a step after it. So while the queued prefill is within two
steps, such a prompt is let through whatever the cap and the processes' parts say. A long
one is not: it would fill that step, and the next short request would wait for it.

Work-conserving: a worker with nothing in flight from this router is never saturated,
whatever its metrics say, so stale or missing metrics (or another client's load) cannot
stall the queue for ever.

Processes of one router each keep their own queue. While ``contenders`` of them have
requests waiting, each keeps to its part of the router-side caps, counted on its own
requests: a shared cap goes to whichever process looks first when a slot frees (the one
whose request just ended), and another's waiting requests, a quiet tenant's among them,
would starve behind it. A prompt longer than its part waits for the worker to drain of
every process's long prompts, so the processes' parts do not add up to several long
prompts queued on one engine. The drained worker then goes to the process whose ``turn``
it is there: the process whose prompt just drained hears of it first and would otherwise
take it again and again, leaving a sibling's long prompts to wait out the queue's TTL.

A short prompt is judged on every process's queued prefill, not on a part: it goes where
at most one step of the cap is queued ahead of it (or it fits the last step of two),
whatever the parts, turns and stalls say, since the engine then starts it in its next
step; held to its process's part, it would wait for that process's own long prompt to
drain. Nor does a short prompt keep a worker from counting as drained: a flood's long
prompt may go beside it, or the quiet tenant's chats would hold the flood off its turns.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.balancer.worker import Worker

# A prompt of at most 1/this of the prefill cap is short: it may join the last step of a
# worker's queued prefill.
SHORT_PROMPT_SHARE = 8


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a worker counts as saturated; a cap of 0 is off."""

    queue_depth: int = 5  # engine's waiting requests (scraped): more than this is saturated
    kv_usage: float = 0.8  # engine's KV cache usage (scraped), 0..1: more than this
    metrics_staleness_s: float = 2.0  # older scrape = saturated (unless idle)
    max_inflight: int = 0  # router-side in-flight requests per worker (0: off)
    max_queued_prefill_tokens: int = 0  # router-side prefill tokens not yet computed (0: off)


def saturated(
    worker: Worker,
    thresholds: Thresholds,
    now: float,
    contenders: int = 1,
    prompt_tokens: int = 0,
    turn: bool = True,
    drained_only: bool = False,
) -> bool:
    """Whether ``worker`` should take no new request of ``prompt_tokens`` now (``now`` on
    the monotonic clock); ``contenders``: this process and those of its siblings with
    requests waiting; ``turn``: whether this process may put a prompt longer than its part
    of the prefill cap on the worker once it has drained; ``drained_only``: a sibling's
    queue has stalled, so this process puts a prompt that does not fit one step ahead only
    on a drained worker in its turn, as the sibling's long prompts wait to
    (``FlowControl``).

    Called for every candidate on the fast path, so it only reads attributes.
    """
    if not worker.healthy or worker.draining:
        return True
    inflight = worker.inflight
    if inflight <= 0:
        return False
    totals = worker.totals
    cap = thresholds.max_queued_prefill_tokens
    queued, drained = 0, True
    if cap:
        queued = totals.prefill_tokens + totals.remote_prefill_tokens
        drained = queued * SHORT_PROMPT_SHARE <= cap  # no long prompt queued
        if prompt_tokens * SHORT_PROMPT_SHARE <= cap and (
            queued < cap
            and queued + prompt_tokens <= cap
            or cap < queued <= 2 * cap - prompt_tokens
        ):
            cap = 0  # one step ahead of it at most: no part, turn or stall applies
        elif drained_only and (not drained or not turn):
            return True
    if contenders > 1:  # this process's part of each cap, on its own requests
        if (
            thresholds.max_inflight
            and worker.local_inflight * contenders >= thresholds.max_inflight
        ):
            return True
        own = totals.prefill_tokens
        if cap and own and own * contenders >= cap:
            return True
        if cap and (own + prompt_tokens) * contenders > cap and (not drained or not turn):
            return True  # past its part, and the worker has not drained or is not its turn
    else:
        if thresholds.max_inflight and inflight >= thresholds.max_inflight:
            return True
        if cap and not drained and (queued >= cap or queued + prompt_tokens > cap):
            return True
    engine = worker.engine
    if engine is None:
        return False
    scraped_at = worker.scraped_at
    if scraped_at is None or now - scraped_at > thresholds.metrics_staleness_s:
        return True
    if engine.waiting > thresholds.queue_depth:
        return True
    kv = engine.kv_usage
    return kv is not None and kv > thresholds.kv_usage
