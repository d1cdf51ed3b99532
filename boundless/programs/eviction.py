"""Program-aware KV eviction: each program's eviction key, from the process table and the policy's order.

The KV pools (``kv/eviction.py``) reuse the free blocks of the lowest key first, least recently used among
equals. A program's key, lowest first:

1. ``FINISHED``: not in the process table (never seen, or dropped after idling past the TTL), or idle past the
   TTL: nothing will read its blocks again, unless another program shares them;
2. every other program by where the policy would serve it next, the last served first: by the priority of its
   most urgent call in the engine, or, idle (off at a tool, or a user's turn), of the call it would make next
   (``SchedulingPolicy.program_priority``). Under plas and atlas that is its queue (from its attained service),
   then its first arrival, so the programs in the lowest-priority queues give up their blocks first and
   the hot ones (the next served) last; under fcfs, idle programs first (their next call queues behind every
   call here), then the calls that arrived last.

Keeping the blocks of the programs served soonest approximates Belady's order (evict what is needed furthest
in the future) with what the scheduler knows. A key is a pure function of the program's record, its standing
in the policy and the clock; it holds until the table reports the program changed (a call arrived, finished,
or changed queue) or, for an idle program, until it reaches the TTL.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from boundless.kv.eviction import FINISHED, ChangeFeeds, EvictionKey
from boundless.programs.policy import SchedulingPolicy
from boundless.programs.process_table import ProcessTable, ProgramRecord

# An idle program counts as finished once idle this many times its longest gap between calls (or the usual
# gap of all programs). With exponentially distributed tool times, a program still running is idle 5 mean gaps
# with probability e^-5 (0.7%); one that finished is recognised within seconds of the gaps it had.
IDLE_GAPS = 5.0


def idle_limit_s(record: ProgramRecord, typical_gap_s: float | None, ttl_s: float) -> float:
    """How long the program may stay idle before it counts as finished: the TTL, or sooner, IDLE_GAPS times
    the longest it has been idle between calls (or the usual gap of all programs, if that is longer)."""
    if typical_gap_s is None:
        return ttl_s
    return min(ttl_s, IDLE_GAPS * max(record.longest_gap_s, typical_gap_s))


def eviction_key(
    record: ProgramRecord | None, priority: tuple[float, ...], now: float, idle_limit_s: float
) -> tuple[EvictionKey, float]:
    """A program's eviction key (higher is kept longer) and the clock time until which it holds.

    ``priority`` is where the policy would serve it next (smaller first); an idle program counts as finished
    once idle for ``idle_limit_s``.
    """
    if record is None:
        return FINISHED, math.inf
    key = (1.0, *(-p for p in priority))  # served later: smaller, reused sooner
    if record.active_calls > 0:
        return key, math.inf
    expires = record.last_activity + idle_limit_s
    if now >= expires:
        return FINISHED, math.inf
    return key, expires


class PolicyRanking:
    """Eviction keys (``kv.eviction.ProgramRanking``) from a policy's process table and order, read against
    ``clock``. Turns on the table's change tracking, and hands each reader its own feed of changes."""

    def __init__(
        self, table: ProcessTable, priority_of: Callable[[str], tuple[float, ...]], clock: Callable[[], float]
    ) -> None:
        self.table = table
        self.priority_of = priority_of
        self.clock = clock
        table.track_changes = True
        self._feeds = ChangeFeeds()

    @classmethod
    def of_policy(cls, policy: SchedulingPolicy, clock: Callable[[], float]) -> PolicyRanking:
        return cls(policy.table, policy.program_priority, clock)

    def eviction_key(self, program_id: str) -> tuple[EvictionKey, float]:
        record = self.table.get(program_id)
        if record is None:
            return FINISHED, math.inf
        limit = idle_limit_s(record, self.table.typical_gap_s, self.table.ttl_s)
        return eviction_key(record, self.priority_of(program_id), self.clock(), limit)

    def now(self) -> float:
        return self.clock()

    def subscribe(self) -> Callable[[], set[str]]:
        take = self._feeds.subscribe()

        def take_changed() -> set[str]:
            # The table records changes once for all readers: whoever asks first publishes them to every feed.
            self._feeds.publish(self.table.take_changed())
            return take()

        return take_changed
