"""One accounted call to one worker: where it goes, its ticket, and how it ended.

The unified path (``Forwarder``) and the P/D legs both run their upstream I/O inside
a ``Call``, so the balancer's passive health (circuit breaker, outlier ejection) sees
one classification of failures whichever path a request took:

- no response head yet: connection refused, reset or unresolvable is
  ``connect_error``; any other client error is ``server_error``;
- the head arrived and then the answer broke off, or a stream that may migrate carried
  the engine's error event: ``server_error`` (the worker was reachable and failed while
  answering, so an early re-probe would learn nothing);
- a deadline passed (first byte, first token, idle stream, leg timeout): ``timeout``;
- an answer with a 5xx status is ``server_error``, any other status ``success``;
- cancelled (the client left, a sibling leg failed) or failed on our side (a header
  the client gave that cannot be written): ``client_abort``, which is not held against
  the worker.

Apart from the outcome, ``may_have_started`` says whether the worker may have begun on
the request, which decides whether another worker may be asked (``router.forward``).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Outcome, Ticket, Worker
from switchyard.net.errors import ConnectError, InvalidHeader, TransportError
from switchyard.router.relay import EngineErrorEvent, UpstreamTimeout

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from switchyard.router.migration import Keeper
    from switchyard.router.tracing import Tracing


class Unsent(Exception):
    """The answer failed after its head but before any byte reached the client, so another
    worker may still answer; ``cause`` is the failure (and what the outcome is made of)."""

    def __init__(self, cause: UpstreamTimeout | TransportError | OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Broken(Exception):
    """A stream that may migrate failed after its first byte reached the client; ``cause``
    is the failure, ``keeper`` what was relayed (``router.migration``)."""

    def __init__(self, cause: BaseException, keeper: Keeper) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.keeper = keeper


def outcome_of(exc: BaseException, answered: bool) -> Outcome:
    """The outcome of a call that raised ``exc``; ``answered``: the response head had arrived.

    The one place the transport's failures (``switchyard.net.errors``) become outcomes."""
    if isinstance(exc, Unsent | Broken):
        exc = exc.cause
    if isinstance(exc, EngineErrorEvent):
        return Outcome.SERVER_ERROR
    if isinstance(exc, InvalidHeader):
        return Outcome.CLIENT_ABORT
    if isinstance(exc, UpstreamTimeout | TimeoutError):
        return Outcome.TIMEOUT
    if answered:
        return Outcome.SERVER_ERROR if isinstance(exc, TransportError) else Outcome.CLIENT_ABORT
    if isinstance(exc, ConnectError | OSError):
        return Outcome.CONNECT_ERROR
    if isinstance(exc, TransportError):
        return Outcome.SERVER_ERROR
    return Outcome.CLIENT_ABORT


def may_have_started(exc: BaseException) -> bool:
    """Whether the worker may have begun on a request that failed with ``exc``: once the
    request was written it may have (a close with no answer, no first byte in time), and
    an answer whose head came certainly has. Refused, a connect or pool timeout, a request
    never written: it cannot have."""
    if isinstance(exc, Unsent):
        return True
    if isinstance(exc, UpstreamTimeout | TransportError):
        return exc.maybe_started
    return False


class Call:
    """A request to ``rank`` of ``worker``, counted in flight from creation until the
    ``with`` block ends; the block's exception (or the answered status) is the outcome.

    Traced (``tracing``), the call is a CLIENT span over the same stretch, and its
    ``headers`` carry that span's traceparent to the worker."""

    __slots__ = (
        "fleet",
        "ticket",
        "url",
        "headers",
        "answered",
        "outcome",
        "status",
        "tracing",
        "span",
    )

    def __init__(
        self,
        fleet: FleetView,
        worker: Worker,
        rank: int | None,
        path: str,
        headers: dict[str, str],
        *,
        prompt_tokens: int,
        prefill_tokens: int | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        base, extra = fleet.address(worker, rank)
        self.url = base + path
        self.headers = {**headers, **extra} if extra else headers
        self.status: int | None = None
        self.tracing = tracing
        self.span: Span | None = None
        if tracing is not None:
            self.span = tracing.client(self.url, path, worker, rank)  # None: sampled out
            self.headers = tracing.inject(self.span, self.headers)
        self.fleet = fleet
        self.ticket: Ticket = fleet.begin(
            worker, prompt_tokens=prompt_tokens, dp_rank=rank, prefill_tokens=prefill_tokens
        )
        self.answered = False
        self.outcome = Outcome.CLIENT_ABORT

    def head(self, status: int) -> None:
        """The response head arrived: from here on a failure is the answer breaking off."""
        self.answered = True
        self.status = status
        self.outcome = Outcome.SERVER_ERROR if status >= 500 else Outcome.SUCCESS

    def __enter__(self) -> Call:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.outcome = outcome_of(exc, self.answered)
        self.fleet.end(self.ticket, self.outcome)
        if self.span is not None:
            assert self.tracing is not None
            self.tracing.end_client(self.span, self.status, str(self.outcome))
