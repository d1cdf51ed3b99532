"""Matching receives with messages, per (peer, tag), in order: the bookkeeping every transport that is
told of messages (shared memory's socket, NIXL's and Mooncake's notifications) shares.

A receive posted before its message waits in a queue; a message that comes before its receive waits in
another. The i-th message from a peer with a tag always goes to the i-th receive of that tag: a receive
that timed out stays in line, cancelled, and swallows its message when it comes, so a late message never
lands in a later receive's tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Key = tuple[str, int]  # (peer address, tag)
P = TypeVar("P")
A = TypeVar("A")


@dataclass(eq=False)
class Posting(Generic[P]):
    """A posted receive: what the transport needs to complete it, and whether it was given up."""

    target: P
    cancelled: bool = False


@dataclass
class Matcher(Generic[P, A]):
    """Posted receives and unexpected arrivals, each FIFO per (peer, tag)."""

    _posted: dict[Key, deque[Posting[P]]] = field(default_factory=dict)
    _arrived: dict[Key, deque[A]] = field(default_factory=dict)

    def post(self, key: Key, target: P) -> tuple[Posting[P], A | None]:
        """Post a receive; returns its posting and the message it takes at once, if one is waiting."""
        posting = Posting(target)
        waiting = self._arrived.get(key)
        if waiting and not self._posted.get(key):
            item = waiting.popleft()
            if not waiting:
                del self._arrived[key]
            return posting, item
        self._posted.setdefault(key, deque()).append(posting)
        return posting, None

    def next_posting(self, key: Key) -> Posting[P] | None:
        """A message came: the posting it completes (possibly a cancelled one, which drops it), or None when
        it must wait for its receive (then the caller :meth:`hold` s a copy of it)."""
        queue = self._posted.get(key)
        if not queue:
            return None
        posting = queue.popleft()
        if not queue:
            del self._posted[key]
        return posting

    def hold(self, key: Key, item: A) -> None:
        """Keep a message that came before its receive."""
        self._arrived.setdefault(key, deque()).append(item)

    def cancel(self, posting: Posting[P]) -> None:
        posting.cancelled = True

    def postings_from(self, peer: str) -> list[Posting[P]]:
        """Every receive still waiting on ``peer`` (to fail them when it is gone), removed from the queues."""
        out: list[Posting[P]] = []
        for key in [k for k in self._posted if k[0] == peer]:
            out.extend(self._posted.pop(key))
        return out

    def waiting_messages(self) -> int:
        return sum(len(q) for q in self._arrived.values())
