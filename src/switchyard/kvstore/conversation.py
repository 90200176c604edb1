"""Conversations seen before: each one's tokenized prefix and its block keys, kept to extend.

Turn k+1 of a chat repeats the messages of turn k and adds one or two. Per conversation a
``Line`` keeps the messages so far, the token ids of their render (without the generation
prompt), where each message's ids end, and the block keys of those ids at each block size
asked. The next turn is checked against it by comparing its messages with the line's (one
list comparison in C: no hashing and no Python step per message of the history), and
only the messages it adds are rendered, tokenized and keyed, so a turn costs what it adds.

A line grows in place while its conversation goes on; a turn that leaves it before its end
(an edited or regenerated message, a branch) starts a line of its own from the part they
share. Lines are found by the keys of their first two messages (a shared system prompt
alone would put every conversation in one bucket); a one-message line (a system prompt) is
never extended in place, so every conversation it starts can branch from it. Least
recently used lines go first, bounded in bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.kvstore.keys import chain_keys, root_key

# What a line costs in memory beyond its parts, a token (a list slot and an int object), a
# block key, and a character of the messages it keeps alive.
_LINE_BYTES = 600
_TOKEN_BYTES = 36
_KEY_BYTES = 40
_CHAR_BYTES = 1
# The bound of the lines of one tokenizer: about a hundred conversations of 16k tokens.
CONVERSATION_BYTES = 128 << 20
# Branches of one conversation kept under its anchor: a client that regenerates an answer
# a few times makes a few.
BRANCHES = 4


def _chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    return len(content) if isinstance(content, str) else 64


class Line:
    """One conversation's messages, their ids (``ends[i]``: the ids of the first ``i``
    messages, ``ends[0]`` the template's prefix) and the block keys of those ids.

    Only ever appended to, so a prefix of its ids or keys never changes once made.
    """

    __slots__ = ("anchor", "messages", "ends", "ids", "keys", "chars")

    def __init__(self, anchor: bytes, messages: list[Any], ends: list[int], ids: list[int]) -> None:
        self.anchor = anchor
        self.messages = messages
        self.ends = ends
        self.ids = ids
        # (block size, seed, extra) -> keys of the first len(keys) * block size ids
        self.keys: dict[tuple[int, int, str | None], list[int]] = {}
        self.chars = sum(_chars(m) for m in messages)

    @property
    def cost(self) -> int:
        keys = sum(len(k) for k in self.keys.values())
        return (
            _LINE_BYTES
            + _TOKEN_BYTES * len(self.ids)
            + _KEY_BYTES * keys
            + _CHAR_BYTES * self.chars
        )

    def common(self, messages: Sequence[Any], limit: int) -> int:
        """How many of the first ``limit`` messages this line holds as they are."""
        mine = self.messages
        n = min(len(mine), limit)
        if mine[:n] == messages[:n]:
            return n
        for i in range(n):
            if mine[i] is not messages[i] and mine[i] != messages[i]:
                return i
        return n

    def branch(self, anchor: bytes, count: int) -> Line:
        """A new line of this one's first ``count`` messages (their ids and keys copied)."""
        end = self.ends[count]
        line = Line(anchor, self.messages[:count], self.ends[: count + 1], self.ids[:end])
        for (size, seed, extra), keys in self.keys.items():
            line.keys[(size, seed, extra)] = keys[: end // size]
        return line

    def extend(self, messages: Sequence[Any], lengths: Sequence[int], ids: list[int]) -> None:
        """Append messages and their ids (``lengths``: how many ids each one has)."""
        end = self.ends[-1]
        for message, length in zip(messages, lengths, strict=True):
            self.messages.append(message)
            end += length
            self.ends.append(end)
            self.chars += _chars(message)
        self.ids.extend(ids)

    def keys_to(self, tokens: int, block_size: int, seed: int, extra: str | None) -> list[int]:
        """Keys of the full blocks of the first ``tokens`` ids (a list of the caller's own);
        the ones not made before are chained from the last one made."""
        keys = self.keys.setdefault((block_size, seed, extra), [])
        need = tokens // block_size
        have = len(keys)
        if have < need:
            parent = keys[-1] if keys else root_key(seed, extra)
            keys += chain_keys(parent, self.ids[have * block_size : need * block_size],
                               block_size, seed)  # fmt: skip
        return keys[:need]


@dataclass(frozen=True, slots=True)
class ChatPrefix:
    """The ids of a chat's first ``count`` messages, from ``line``, then ``suffix`` (the
    generation prompt, or nothing)."""

    line: Line
    count: int
    suffix: list[int]

    @property
    def tokens(self) -> int:
        return self.line.ends[self.count] + len(self.suffix)

    def ids(self) -> list[int]:
        return self.line.ids[: self.line.ends[self.count]] + self.suffix

    def keys(self, block_size: int, seed: int = 0, extra: str | None = None) -> list[int]:
        """The same keys as ``block_keys(self.ids(), ...)``, made once per line and size."""
        end = self.line.ends[self.count]
        keys = self.line.keys_to(end, block_size, seed, extra)
        if self.suffix:
            tail = self.line.ids[len(keys) * block_size : end] + self.suffix
            parent = keys[-1] if keys else root_key(seed, extra)
            keys += chain_keys(parent, tail, block_size, seed)
        return keys


class ConversationCache:
    """Lines by anchor, least recently used out first, bounded in bytes (see the module
    docstring). ``hits`` and ``misses`` count the chats that found a line or did not."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._anchors: dict[bytes, list[Line]] = {}
        self._lru: OrderedDict[int, tuple[Line, int]] = OrderedDict()  # id -> (line, cost)

    def __len__(self) -> int:
        return len(self._lru)

    def find(
        self, anchors: Sequence[bytes], messages: Sequence[Any], limit: int
    ) -> tuple[Line, int] | None:
        """The line sharing the most of the first ``limit`` messages (at least one), and
        how many it shares; anchors are tried in order, the first that gives one wins."""
        for anchor in anchors:
            best: tuple[Line, int] | None = None
            for line in self._anchors.get(anchor, ()):
                shared = line.common(messages, limit)
                if shared and (best is None or shared > best[1]):
                    best = (line, shared)
            if best is not None:
                self.hits += 1
                self._lru.move_to_end(id(best[0]))
                return best
        self.misses += 1
        return None

    def put(self, line: Line) -> None:
        """Add ``line``, or count what it grew by since it was added."""
        held = self._lru.get(id(line))
        cost = line.cost
        if held is not None and held[0] is line:
            self.bytes += cost - held[1]
            self._lru[id(line)] = (line, cost)
            self._lru.move_to_end(id(line))
        else:
            lines = self._anchors.setdefault(line.anchor, [])
            lines.insert(0, line)
            if len(lines) > BRANCHES:
                self._drop(lines[-1])
            self._lru[id(line)] = (line, cost)
            self.bytes += cost
        while self.bytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru.values()))[0])

    def _drop(self, line: Line) -> None:
        held = self._lru.pop(id(line), None)
        if held is None:
            return
        self.bytes -= held[1]
        lines = self._anchors.get(line.anchor)
        if lines is not None:
            lines.remove(line)
            if not lines:
                del self._anchors[line.anchor]
