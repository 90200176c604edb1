"""Who a request is, for flow control: its tenant, its priority band and its deadline.

Priorities are plain integers, higher first, so operators can add bands without a new name;
the names are the common three. A negative priority marks a request the router may shed
(answer 429 at once) when every engine is saturated, rather than queue.

``x-smg-priority`` is read as an alias so clients of smg (the SGLang model gateway) keep
their header. Its classes map onto our bands without granting more than ``high``:
``system`` and ``interactive`` are ``high``, ``default`` is ``normal``, ``bulk`` is ``low``
(sheddable). smg degrades an unknown class to ``default`` rather than failing the request,
and so does the alias here; our own ``x-priority`` refuses a bad value instead, because a
typo in a header we define should be seen, not guessed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

PRIORITY_NAMES = {"high": 1, "normal": 0, "low": -1}
SMG_PRIORITY_NAMES = {"system": 1, "interactive": 1, "default": 0, "bulk": -1}
DEFAULT_TENANT = "default"
# Priority headers and the tenant alias the router reads (lower-case, as the app sees them).
PRIORITY_HEADER = "x-priority"
SMG_PRIORITY_HEADER = "x-smg-priority"
DEADLINE_HEADER = "x-slo-ttft-ms"
FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
# The highest priority a tenant may ask for when ``max_priority`` does not name it (nor
# "*"): a client's own header should not lift it above every other tenant's ``high``.
DEFAULT_MAX_PRIORITY = PRIORITY_NAMES["high"]
# Integers beyond this are refused: a band number is a small label, not a counter.
PRIORITY_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's place in the flow-control queue."""

    tenant: str  # from the API key (TENANT:KEY), else "default"; or a trusted header
    priority: int  # higher first; negative = sheddable
    deadline_ms: float | None = None  # x-slo-ttft-ms (or the tenant's objective), for EDF

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


def _parse_int(text: str) -> int | None:
    body = text[1:] if text[:1] in "+-" else text
    if not body.isascii() or not body.isdigit():
        return None
    number = int(text)
    if abs(number) > PRIORITY_LIMIT:
        raise ValueError(f"priority {text!r} is out of range (-{PRIORITY_LIMIT}..{PRIORITY_LIMIT})")
    return number


def parse_priority(value: str | None, *, smg: str | None = None) -> int:
    """The band of ``x-priority: value`` (or of ``x-smg-priority: smg`` when it is absent).

    Names are case-insensitive and may be padded; integers may be signed. A bad
    ``x-priority`` raises ``ValueError`` (the app answers 400).
    """
    if value is not None:
        text = value.strip().lower()
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        number = _parse_int(text)
        if number is None:
            names = ", ".join(PRIORITY_NAMES)
            raise ValueError(f"x-priority must be one of {names} or an integer, not {value!r}")
        return number
    if smg is not None:
        text = smg.strip().lower()
        if text in SMG_PRIORITY_NAMES:
            return SMG_PRIORITY_NAMES[text]
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        number = _parse_int(text)
        return PRIORITY_NAMES["normal"] if number is None else number
    return PRIORITY_NAMES["normal"]


def clamp_priority(
    priority: int,
    tenant: str,
    max_by_tenant: Mapping[str, int],
    *,
    default: int = DEFAULT_MAX_PRIORITY,
) -> int:
    """``priority`` lowered to the tenant's ceiling: ``max_by_tenant[tenant]``, else
    ``max_by_tenant["*"]``, else ``default``. Only ever lowers, so a low-tier tenant cannot
    promote itself with a header, and a sheddable request stays sheddable."""
    ceiling = max_by_tenant.get(tenant)
    if ceiling is None:
        ceiling = max_by_tenant.get("*", default)
    return min(priority, ceiling)


def parse_deadline_ms(value: str | None) -> float | None:
    """``x-slo-ttft-ms`` as milliseconds (None when absent); a bad value raises ``ValueError``."""
    if value is None:
        return None
    try:
        deadline = float(value.strip())
    except ValueError:
        raise ValueError(f"x-slo-ttft-ms must be a number of milliseconds, not {value!r}") from None
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"x-slo-ttft-ms must be a positive number of milliseconds, not {value!r}")
    return deadline


def resolve_tenant(
    key_tenant: str | None,
    headers: Mapping[str, str],
    tenant_header: str | None = None,
) -> str:
    """The tenant a request is queued under.

    With ``tenant_header`` set (``--flow-tenant-header``: a trusted gateway in front names
    the tenant), that header, else ``x-llm-d-inference-fairness-id``, names it; otherwise, or
    when neither is sent, the tenant of the API key, else ``"default"``. ``headers`` is read
    with lower-case names.
    """
    if tenant_header:
        for name in (tenant_header.lower(), FAIRNESS_ID_HEADER):
            named = headers.get(name)
            if named is not None and named.strip():
                return named.strip()
    return key_tenant or DEFAULT_TENANT
