"""``FleetView``: what the router and its scheduler need from a fleet.

Two implementations: ``Fleet`` (embedded: this process probes and counts) and
``RemoteFleet`` (a balancer service is the authority; counts are mirrored). The
hot-path methods are synchronous and touch memory only; DP-rank addressing lives
in ``address`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from switchyard.balancer.worker import Outcome, Role, Ticket, Worker, WorkerSpec

Listener = Callable[[str, Worker], None]


class FleetView(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    # Hot path

    def candidates(self, model: str | None, role: Role = Role.UNIFIED) -> list[Worker]:
        """Workers that may take a request now."""

    def choose_rank(self, worker: Worker, *, prompt_tokens: int = 0) -> int | None:
        """The DP rank for a new request (None for a single-rank worker)."""

    def address(self, worker: Worker, rank: int | None) -> tuple[str, Mapping[str, str]]:
        """Base URL and extra headers that reach ``rank`` of ``worker``."""

    def begin(
        self,
        worker: Worker,
        *,
        prompt_tokens: int = 0,
        dp_rank: int | None = None,
        prefill_tokens: int | None = None,
    ) -> Ticket: ...

    def first_token(self, ticket: Ticket) -> None: ...

    def progress(self, ticket: Ticket, generated_tokens: int) -> None: ...

    def end(self, ticket: Ticket, outcome: Outcome) -> None: ...

    # Registry

    def add(self, spec: WorkerSpec, source: str = ...) -> Worker: ...

    def remove(self, worker_id: str, *, broadcast: bool = True) -> bool: ...

    def drain(
        self, worker_id: str, *, remove_when_idle: bool = False, broadcast: bool = True
    ) -> bool: ...

    def undrain(self, worker_id: str, *, broadcast: bool = True) -> bool: ...

    def get(self, worker_id: str) -> Worker | None: ...

    def workers(self) -> list[Worker]: ...

    def models(self) -> list[str]: ...

    def has_model(self, model: str) -> bool: ...

    def parent_of(self, model: str) -> str | None:
        """The base model of a LoRA adapter some worker lists, else None."""

    async def refresh_models(self, workers: Iterable[Worker] | None = None) -> None:
        """Read the workers' models again now (rate-limited when ``workers`` is None)."""

    def subscribe(self, callback: Listener) -> None: ...

    def describe(self) -> list[dict[str, Any]]: ...
