"""Three priority bands of one tenant: a batch flood, interactive chats and sheddable work.

The batch band sends long prompts with no ``x-priority`` (band 0, ``normal``) at
``batch_x`` times ``rate``; the interactive band short chats with ``x-priority: high`` at
``interactive_share`` times ``rate``; the sheddable band short requests with ``x-priority:
low`` (band -1: the router may refuse it at once under saturation) at ``sheddable_share``
times ``rate``. ``rate`` is meant to be the fleet's capacity in batch requests a second, so
the batch band alone overloads it and the interactive band alone barely uses it: priority,
not fair share, must keep the interactive band's time to first token near its solo
value, since every band is one tenant (no API key).

Each band has its own random generator, so a band's requests are the same whatever the
others' rates (``batch_x=0, sheddable_share=0`` is the interactive band's solo run of
exactly the requests it sends beside the flood). ``Request.tenant`` holds the band's
name, to split the results by band.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Request, Workload

BATCH, INTERACTIVE, SHEDDABLE = "batch", "interactive", "sheddable"
# The header each band sends (none: the default band, 0).
HEADERS: dict[str, tuple[tuple[str, str], ...]] = {
    BATCH: (),
    INTERACTIVE: (("x-priority", "high"),),
    SHEDDABLE: (("x-priority", "low"),),
}


@dataclass
class BandsParams:
    rate: float = 2.0  # the fleet's capacity in batch requests per second
    duration_s: float = 20.0
    batch_x: float = 3.0  # the batch band's rate as a multiple of ``rate``; 0: none
    interactive_share: float = 0.2  # the interactive band's rate as a share of ``rate``
    sheddable_share: float = 0.2  # the sheddable band's rate as a share of ``rate``
    batch_prompt_tokens: tuple[int, int] = (1500, 2500)
    short_prompt_tokens: tuple[int, int] = (30, 120)
    max_tokens: int = 16


def _stream(
    seed: int, band: str, rate: float, duration_s: float, tokens: tuple[int, int], bank: WordBank
) -> list[tuple[float, str, str]]:
    """One band's (arrival, band, prompt) within ``duration_s``, from its own seed."""
    out: list[tuple[float, str, str]] = []
    if rate <= 0:
        return out
    rng = random.Random(f"bands:{seed}:{band}")
    t = 0.0
    while t < duration_s:
        out.append((t, band, bank.text(f"bands:{seed}:{band}:{len(out)}", rng.randint(*tokens))))
        t += rng.expovariate(rate)
    return out


def bands(seed: int, p: BandsParams, bank: WordBank | None = None) -> Workload:
    """Every band's requests merged in arrival order; ``session`` is band:n."""
    shares = (p.batch_x, p.interactive_share, p.sheddable_share)
    if min(shares) < 0 or not any(shares):
        raise ValueError("batch_x and the bands' shares must be >= 0, and not all 0")
    bank = bank or default_bank()
    streams = [
        _stream(seed, BATCH, p.batch_x * p.rate, p.duration_s, p.batch_prompt_tokens, bank),
        _stream(
            seed, INTERACTIVE, p.interactive_share * p.rate, p.duration_s,
            p.short_prompt_tokens, bank,
        ),
        _stream(
            seed, SHEDDABLE, p.sheddable_share * p.rate, p.duration_s,
            p.short_prompt_tokens, bank,
        ),
    ]  # fmt: skip
    merged = sorted((x for s in streams for x in s), key=lambda x: (x[0], x[1]))
    requests = [
        Request(
            i,
            t,
            [{"role": "user", "content": text}],
            p.max_tokens,
            f"{band}:{i}",
            band,
            headers=HEADERS[band],
        )  # fmt: skip
        for i, (t, band, text) in enumerate(merged)
    ]
    return Workload("bands", seed, requests, dict(vars(p)))
