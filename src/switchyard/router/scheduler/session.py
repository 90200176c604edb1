"""Where a session lives: one rendezvous ranking shared by every session-aware component.

Highest-random-weight hashing ranks the workers by ``hash(session, worker)``; the first
is the session's home. Adding or removing a worker moves only the sessions it gains or
loses, and the rest of the ranking is the failover order. The session-affinity scorer
and the consistent-hash picker both rank with this one function, so they always agree
on a session's home worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def session_ranking(session_key: str, worker_ids: Sequence[str]) -> list[int]:
    """Indexes into ``worker_ids``, the session's home first."""
    key = session_key.encode()
    weights = [xxhash.xxh3_64_intdigest(key + b"\x00" + wid.encode()) for wid in worker_ids]
    return sorted(range(len(worker_ids)), key=lambda i: (weights[i], worker_ids[i]), reverse=True)
