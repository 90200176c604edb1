"""One publisher's event stream: sequence tracking in front of its ingestor.

vLLM numbers every batch per publisher (``seq`` frame). A jump forward is a gap (we
missed batches: replay them or clear); a jump backward is a restarted publisher
(its old blocks and hash map are void) unless it is the overlap of our own replay.

A feed is stale from the moment its publisher's connection is found dead or lost until
it has resynced (reconnected and its first frame handled, a gap replayed on the way):
what its index entries say may be out of date meanwhile, so the router estimates that
instance's cache from its own placements instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from switchyard.kvstore.ingest import Ingestor


class Verdict(Enum):
    OK = "ok"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


@dataclass(slots=True)
class FeedInfo:
    instance: str
    source: str
    endpoint: str | None
    replay_endpoint: str | None
    last_seq: int | None
    last_ts: float | None
    gaps: int
    replays: int
    stale: bool = False


class Feed:
    def __init__(
        self,
        ingestor: Ingestor,
        source: str,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        self.ingestor = ingestor
        self.source = source
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.gaps = 0
        self.replays = 0
        self.stale = False
        self.stale_since: float | None = None  # monotonic time the connection went
        self.catching_up = False  # replaying what the publisher buffered before we joined
        # Sequence numbers in (dup_floor, last_seq] were already applied by a replay.
        self.dup_floor: int | None = None
        # Orders this publisher's updates with a rewrite of its entries after an outage.
        self.lock = asyncio.Lock()

    @property
    def instance(self) -> str:
        return self.ingestor.instance

    def classify(self, seq: int) -> Verdict:
        last = self.last_seq
        if last is None or seq == last + 1:
            return Verdict.OK
        if seq > last + 1:
            return Verdict.GAP
        if self.dup_floor is not None and seq > self.dup_floor:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def info(self) -> FeedInfo:
        return FeedInfo(
            self.instance,
            self.source,
            self.endpoint,
            self.replay_endpoint,
            self.last_seq,
            self.last_ts,
            self.gaps,
            self.replays,
            self.stale,
        )
