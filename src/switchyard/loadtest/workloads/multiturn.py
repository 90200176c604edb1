"""Multi-turn chat: tenants share a system prompt, each user's history grows turn by turn.

This is the reuse a KV-aware router lives on: turn k+1 of a session starts with the
whole prompt of turn k plus the assistant's answer, and every session of a tenant
starts with the tenant's system prompt. Assistant answers are fixed text (not the
mock's output) so the workload is fully determined by its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Message, Request, Workload, poisson_arrivals


@dataclass
class MultiTurnParams:
    rate: float = 8.0
    duration_s: float = 20.0
    tenants: int = 4
    system_tokens: int = 1000
    active_sessions: int = 24
    turns: int = 6
    user_tokens: tuple[int, int] = (60, 200)
    answer_tokens: int = 48
    max_tokens: int = 48


def multiturn(seed: int, p: MultiTurnParams, bank: WordBank | None = None) -> Workload:
    """Poisson arrivals; each arrival is the next turn of a random active session.

    A session that reached ``turns`` is replaced by a fresh one (random tenant), so
    about ``active_sessions`` conversations are open at any time and consecutive turns
    of one session are ``active_sessions / rate`` seconds apart on average.
    """
    bank = bank or default_bank()
    rng = random.Random(f"multiturn:{seed}")
    systems = [bank.text(f"sys:{seed}:{t}", p.system_tokens) for t in range(p.tenants)]
    count = max(1, int(p.rate * p.duration_s))
    next_id = 0

    def new_session() -> tuple[str, int, list[Message]]:
        nonlocal next_id
        next_id += 1
        tenant = rng.randrange(p.tenants)
        return f"s{next_id}", tenant, [{"role": "system", "content": systems[tenant]}]

    sessions = [new_session() for _ in range(p.active_sessions)]
    requests = []
    for i, t in enumerate(poisson_arrivals(rng, p.rate, count)):
        slot = rng.randrange(len(sessions))
        sid, tenant, history = sessions[slot]
        n_user = rng.randint(*p.user_tokens)
        history = [*history, {"role": "user", "content": bank.text(f"u:{seed}:{i}", n_user)}]
        requests.append(Request(i, t, history, p.max_tokens, sid, f"t{tenant}"))
        answer = {"role": "assistant", "content": bank.text(f"a:{seed}:{i}", p.answer_tokens)}
        history = [*history, answer]
        turns_done = (len(history) - 1) // 2
        sessions[slot] = new_session() if turns_done >= p.turns else (sid, tenant, history)
    return Workload("multiturn", seed, requests, dict(vars(p)))
