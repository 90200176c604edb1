"""What the routes beside the three OpenAI ones need on top of them: Anthropic Messages,
OpenAI Responses, the pass-through routes, and model aliases on any route.

The data path hands an answer to ``AnswerFilter`` instead of the client's response only
for those requests, so the three OpenAI routes without an alias pay nothing for it. The
filter renames the served model to the public one in the answer's bytes, notes which
worker holds a Responses answer (``ResponseHolders``), and says clearly when a worker does
not serve the route at all.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack
import orjson
from starlette.types import Message, Send

from switchyard.core.packing import packb
from switchyard.net.httpclient import PieceWriter
from switchyard.router.errors import RouterError, anthropic_error_body
from switchyard.router.forward import WORKER_HEADER
from switchyard.router.request import ANTHROPIC_ROUTES

if TYPE_CHECKING:
    from switchyard.balancer.siblings import SiblingBus

RESPONSE_HOLDER = b"respid"  # sibling-bus topic: a Responses answer's id and its worker
# Response ids remembered per router process; the oldest is forgotten first.
MAX_RESPONSE_IDS = 100_000
# A Responses answer's id: the first "id" of its JSON body or of its stream's first event.
_ID = re.compile(rb'"id"\s*:\s*"((?:[^"\\]|\\.)+)"')
# What a FastAPI engine answers for a path it has no route for.
_NO_ROUTE = b'{"detail":"Not Found"}'


class ResponseHolders:
    """Response id -> the worker that answered it (and holds it, for
    ``previous_response_id``, GET and cancel), least recently used forgotten first.
    Shared with the other processes of this router over the sibling bus: the next turn
    may come to any of them."""

    def __init__(self, limit: int = MAX_RESPONSE_IDS, siblings: SiblingBus | None = None) -> None:
        self.limit = limit
        self.siblings = siblings
        self._held: OrderedDict[str, str] = OrderedDict()
        if siblings is not None:
            siblings.on(RESPONSE_HOLDER, self._on_sibling)

    def __len__(self) -> int:
        return len(self._held)

    def holder(self, response_id: str) -> str | None:
        worker = self._held.get(response_id)
        if worker is not None:
            self._held.move_to_end(response_id)
        return worker

    def remember(self, response_id: str, worker: str) -> None:
        self._put(response_id, worker)
        if self.siblings is not None:
            self.siblings.publish(RESPONSE_HOLDER, packb((response_id, worker)), lazy=True)

    def _put(self, response_id: str, worker: str) -> None:
        held = self._held
        held[response_id] = worker
        held.move_to_end(response_id)
        if len(held) > self.limit:
            held.popitem(last=False)

    def _on_sibling(self, origin: str, payload: bytes) -> None:
        response_id, worker = msgpack.unpackb(payload)
        self._put(response_id, worker)


def renaming(served: str, public: str) -> tuple[bytes, bytes]:
    """The exact JSON member an answer names the served model with, and its public form."""
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(public)


class AnswerFilter:
    """The client's response as the forwarder sees it, for a request on an API route or
    naming an alias. The head waits for the first body bytes (it goes out with them
    anyway), so a body whose length changes gets its new content-length."""

    __slots__ = ("inner", "route", "rename", "on_id", "_start", "_want_id", "_worker", "_held")

    def __init__(
        self,
        inner: Send,
        route: str,
        rename: tuple[bytes, bytes] | None,
        on_id: Callable[[str, str], None] | None,
    ) -> None:
        """``inner``: the client's response (``app._Response``); ``rename``: (served,
        public) JSON members to swap in the answer; ``on_id``: told (response id, worker)
        of a Responses answer."""
        self.inner = inner
        self.route = route
        self.rename = rename
        self.on_id = on_id
        self._start: Message | None = None
        self._want_id = on_id is not None
        self._worker = ""
        self._held = b""  # a streamed piece's end that may begin the served model's member

    def stream_writer(self) -> PieceWriter | None:
        """The server's writer of streamed pieces, renaming and looking for the id too."""
        offered = getattr(self.inner, "stream_writer", None)
        write: PieceWriter | None = offered() if offered is not None else None
        if write is None or (self.rename is None and not self._want_id):
            return write
        rename = self.rename

        def filtered(chunk: bytes) -> object:
            if self._want_id:
                self._find_id(chunk)
            if rename is not None:
                chunk = self._renamed(chunk, True)
            return write(chunk)

        return filtered  # type: ignore[return-value]  # same call, same result

    def _find_id(self, body: bytes) -> None:
        found = _ID.search(body)
        if found is not None and self.on_id is not None:
            self._want_id = False
            self.on_id(found.group(1).decode("utf-8", "replace"), self._worker)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            for key, value in message.get("headers", ()):
                if key == WORKER_HEADER:
                    self._worker = value.decode("latin-1")
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        start, self._start = self._start, None
        if start is not None:
            status = start["status"]
            if status == 404 and body == _NO_ROUTE:
                body = self._no_route()
            elif status == 200 and self._want_id:
                self._find_id(body)
            elif status != 200:
                self._want_id = False
        elif self._want_id:
            self._find_id(body)
        if self.rename is not None and (body or self._held):
            body = self._renamed(body, more)
        if start is not None:
            if not more:
                start = _with_length(start, len(body))
            await self.inner(start)
        await self.inner({"type": "http.response.body", "body": body, "more_body": more})

    def _renamed(self, piece: bytes, more: bool) -> bytes:
        """``piece`` renamed, less a tail that may begin the served model's member, which
        waits for the next piece: a stream's pieces are cut where the reads fell."""
        assert self.rename is not None
        old, new = self.rename
        data = (self._held + piece).replace(old, new)
        self._held = b""
        if more:
            i = data.find(b'"', max(0, len(data) - len(old) + 1))
            while i != -1:
                if old.startswith(data[i:]):
                    self._held = data[i:]
                    return data[:i]
                i = data.find(b'"', i + 1)
        return data

    def _no_route(self) -> bytes:
        message = f"Worker {self._worker} does not serve {self.route}"
        if self.route in ANTHROPIC_ROUTES:
            return anthropic_error_body(404, message)
        return RouterError(404, message, code="route_not_served").body()


def _with_length(start: Message, length: int) -> Message:
    headers = start.get("headers", ())
    if not any(k == b"content-length" for k, _ in headers):
        return start
    fixed = [(k, v) for k, v in headers if k != b"content-length"]
    fixed.append((b"content-length", str(length).encode()))
    return {**start, "headers": fixed}
