"""Two tenants, one noisy: a flood of long prompts beside a trickle of short chats.

Tenant A offers ``flood_x`` times ``rate`` (open-loop Poisson arrivals of long prompts),
tenant B ``quiet_share`` times ``rate`` of short interactive chats. ``rate`` is meant to
be what the fleet serves of A's requests per second, so A alone overloads it and B alone
barely uses it: a fair router keeps B's time to first token near its solo value however
hard A pushes. Each request carries its tenant's API key, the router's way to tell
tenants apart.

The two arrival streams have their own random generators, so B's requests are the same
whatever A's rate (``flood_x=0`` gives B's solo run of exactly the requests it sends
beside the flood). With ``quiet_turns`` above 1, B's requests are the turns of
``quiet_sessions`` chats open at once, taken in turn: each turn's prompt is its chat's
history (earlier prompts and fixed answers of ``quiet_answer_tokens``) and a new short
message, the reuse a KV-aware router keeps a chat on one engine for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Message, Request, Workload


@dataclass
class NoisyParams:
    rate: float = 2.0  # the fleet's capacity in A's requests per second
    duration_s: float = 20.0
    flood_x: float = 3.0  # A's rate as a multiple of ``rate``; 0: B alone
    quiet_share: float = 0.2  # B's rate as a share of ``rate``; 0: A alone
    flood_prompt_tokens: tuple[int, int] = (1500, 2500)
    quiet_prompt_tokens: tuple[int, int] = (30, 120)
    max_tokens: int = 16
    quiet_turns: int = 1  # turns of each of B's chats; 1: every request a new chat
    quiet_sessions: int = 4  # B's chats open at once, when they have several turns
    quiet_answer_tokens: int = 32  # each earlier turn's answer, in the history
    flood_tenant: str = "A"
    quiet_tenant: str = "B"
    flood_key: str = "noisy-a-key"
    quiet_key: str = "noisy-b-key"


def _stream(
    seed: int,
    tenant: str,
    key: str,
    rate: float,
    duration_s: float,
    tokens: tuple[int, int],
    bank: WordBank,
) -> list[tuple[float, str, str, str]]:
    """One tenant's (arrival, tenant, key, prompt) within ``duration_s``, from its own seed.

    Arrivals stop at ``duration_s`` rather than after a fixed count, so both tenants span
    the same window (a fixed count of a slow stream can end seconds after the flood)."""
    out: list[tuple[float, str, str, str]] = []
    if rate <= 0:
        return out
    rng = random.Random(f"noisy:{seed}:{tenant}")
    t = 0.0
    while t < duration_s:
        text = bank.text(f"noisy:{seed}:{tenant}:{len(out)}", rng.randint(*tokens))
        out.append((t, tenant, key, text))
        t += rng.expovariate(rate)
    return out


def noisy(seed: int, p: NoisyParams, bank: WordBank | None = None) -> Workload:
    """Both tenants' requests merged in arrival order; ``session`` is tenant:n."""
    if p.flood_tenant == p.quiet_tenant or p.flood_key == p.quiet_key:
        raise ValueError("the two tenants need different names and keys")
    if p.flood_x < 0 or p.quiet_share < 0 or p.flood_x + p.quiet_share == 0:
        raise ValueError("flood_x and quiet_share must be >= 0, and not both 0")
    bank = bank or default_bank()
    a = _stream(
        seed, p.flood_tenant, p.flood_key, p.flood_x * p.rate, p.duration_s,
        p.flood_prompt_tokens, bank,
    )  # fmt: skip
    b = _stream(
        seed, p.quiet_tenant, p.quiet_key, p.quiet_share * p.rate, p.duration_s,
        p.quiet_prompt_tokens, bank,
    )  # fmt: skip
    chats = _chats(seed, p, b, bank)
    requests = []
    for i, (t, tenant, key, text) in enumerate(sorted([*a, *b], key=lambda x: (x[0], x[1]))):
        messages, session = chats.get((t, text), ([{"role": "user", "content": text}], ""))
        session = session or f"{tenant}:{i}"
        requests.append(Request(i, t, messages, p.max_tokens, session, tenant, key))
    return Workload("noisy", seed, requests, dict(vars(p)))


def _chats(
    seed: int, p: NoisyParams, quiet: list[tuple[float, str, str, str]], bank: WordBank
) -> dict[tuple[float, str], tuple[list[Message], str]]:
    """B's requests as the turns of its chats, by (arrival, message): the history each
    turn sends and its chat's name; none when every request is a chat of its own."""
    if p.quiet_turns <= 1:
        return {}
    out: dict[tuple[float, str], tuple[list[Message], str]] = {}
    open_chats: list[tuple[str, list[Message]]] = []
    started = 0
    for n, (t, tenant, _, text) in enumerate(quiet):
        slot = n % p.quiet_sessions
        if slot >= len(open_chats):
            open_chats.append((f"{tenant}:chat{started}", []))
            started += 1
        name, history = open_chats[slot]
        history = [*history, {"role": "user", "content": text}]
        out[(t, text)] = (history, name)
        answer = bank.text(f"noisy:{seed}:{tenant}:answer:{n}", p.quiet_answer_tokens)
        history = [*history, {"role": "assistant", "content": answer}]
        if len(history) // 2 >= p.quiet_turns:
            open_chats[slot] = (f"{tenant}:chat{started}", [])
            started += 1
        else:
            open_chats[slot] = (name, history)
    return out
