"""Program-aware KV eviction: each program's eviction class, from the process table and the policy's queues.

The KV pools (``kv/eviction.py``) evict the blocks of the lowest class first, least recently used among
equals. A program's class, lowest first:

1. ``FINISHED`` (0): not in the process table (never seen, or dropped after idling past the TTL) or idle past
   the TTL: nothing will read its blocks again, unless another program shares them;
2. idle programs (no call in the engine: off at a tool, or a user's turn), the lowest priority first: by the
   queue its next call would start in (plas, atlas: from its attained service; fcfs and mlfq have one
   level);
3. hot programs (a call in the engine), again the lowest priority first.

The class is a pure function of the program's record, its level and the clock; it holds until the record
changes (the table reports which did) or, for an idle program, until it reaches the TTL.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from boundless.kv.eviction import FINISHED
from boundless.programs.policy import SchedulingPolicy
from boundless.programs.process_table import ProcessTable, ProgramRecord


def eviction_class(
    record: ProgramRecord | None, level: int, num_levels: int, now: float, ttl_s: float
) -> tuple[int, float]:
    """A program's eviction class (higher is kept longer) and the clock time until which it holds."""
    if record is None:
        return FINISHED, math.inf
    by_priority = num_levels - min(max(level, 0), num_levels - 1)  # 1 (the lowest priority) .. num_levels
    if record.active_calls > 0:
        return num_levels + by_priority, math.inf
    expires = record.last_activity + ttl_s
    if now >= expires:
        return FINISHED, math.inf
    return by_priority, expires


class PolicyRanking:
    """Eviction classes (``kv.eviction.ProgramRanking``) over a policy's process table and queue levels, read
    against ``clock``. Turns on the table's change tracking, and hands each reader its own feed of changes."""

    def __init__(
        self,
        table: ProcessTable,
        level_of: Callable[[str], int],
        num_levels: int,
        clock: Callable[[], float],
    ) -> None:
        self.table = table
        self.level_of = level_of
        self.num_levels = num_levels
        self.clock = clock
        table.track_changes = True
        self._feeds: list[set[str]] = []

    @classmethod
    def of_policy(cls, policy: SchedulingPolicy, clock: Callable[[], float]) -> PolicyRanking:
        return cls(policy.table, policy.next_call_level, policy.num_levels, clock)

    def eviction_class(self, program_id: str) -> tuple[int, float]:
        record = self.table.get(program_id)
        level = self.level_of(program_id) if record is not None else 0
        return eviction_class(record, level, self.num_levels, self.clock(), self.table.ttl_s)

    def now(self) -> float:
        return self.clock()

    def subscribe(self) -> Callable[[], set[str]]:
        pending: set[str] = set()
        self._feeds.append(pending)

        def take() -> set[str]:
            changed = self.table.take_changed()
            if changed:
                for feed in self._feeds:
                    feed |= changed
            out = set(pending)
            pending.clear()
            return out

        return take
