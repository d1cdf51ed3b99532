"""Which free block an allocation takes: a block pool's eviction order.

A pool's free blocks wait in an :class:`EvictionOrder`; an allocation takes the block it names. Two orders:

- :class:`LRUOrder` (``--kv-eviction lru``): the least recently used free block, named or not (vLLM's free
  queue, and the baseline);
- :class:`ProgramAwareOrder` (``--kv-eviction program``): first free blocks with no name (reusing one loses
  nothing), then named blocks by the *eviction key* of the programs that own them, lowest first, and the
  least recently used among equals. A block's owners are the programs whose requests took a reference on it
  since it was named; shared by several, it belongs to the hottest of them (its key is their highest).

Keys come from a :class:`ProgramRanking` (``programs/eviction.py``: programs that finished or idled past their
TTL lowest, then the others by where the policy would serve them next, the last served lowest). A program's
key changes when its record in the program table does, or when the clock passes the time its ranking said it
held until (an idle program reaching its TTL), so the order is a pure function of the blocks' owners, the
table's state and a clock. It stays cheap per allocation: one lazily cleaned heap, and only the free blocks of
a program whose key changed are re-keyed, when the change is first seen.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

# Where a free block stands in the program-aware order: smaller is reused first. Tuples of numbers, compared
# in order.
EvictionKey = tuple[float, ...]
# A free block with no name: reused before any named one.
UNNAMED: EvictionKey = (-1.0,)
# The lowest key of a named block: its programs are finished, idle past their TTL, or unknown.
FINISHED: EvictionKey = (0.0,)
# A block shared by more programs than this drops its finished owners when re-keyed (they rank lowest, so they
# never decide its key while another owner lives), which keeps re-keying it cheap.
PRUNE_OWNERS_ABOVE = 8


class EvictionOrder(Protocol):
    """The free blocks of one pool, in the order allocations take them."""

    # Whether the order keeps the programs that own blocks (:meth:`own`): one that does not need not be told.
    keeps_owners: bool

    def __len__(self) -> int: ...

    def __contains__(self, block_id: int) -> bool: ...

    def __iter__(self) -> Iterator[int]: ...

    def add(self, block_id: int, named: bool) -> None:
        """The block became free (its last reference went): it is the most recently used."""
        ...

    def remove(self, block_id: int) -> None:
        """A free block was taken by a prefix hit (revived with its name)."""
        ...

    def refresh(self, block_id: int, owner: str | None = None) -> None:
        """A block was used again (the most recently used, if free); ``owner``'s program used it."""
        ...

    def pop(self) -> int:
        """Take the next block to reuse out of the order."""
        ...

    def own(self, block_id: int, owner: str | None, fresh: bool = False) -> None:
        """A request of program ``owner`` took a reference on the block; ``fresh``: the block was just reused,
        so whoever owned it before no longer does."""
        ...

    def owners(self, block_id: int) -> tuple[str, ...]:
        """The programs that own the block (none under LRU)."""
        ...

    def unnamed(self, block_id: int) -> None:
        """The block lost its name (dropped from the prefix cache)."""
        ...


class LRUOrder:
    """The least recently used free block first, named or not: one ordered queue (freed blocks join its tail)."""

    keeps_owners = False

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._free)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._free

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)

    def add(self, block_id: int, named: bool) -> None:
        self._free[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._free[block_id]

    def refresh(self, block_id: int, owner: str | None = None) -> None:
        if block_id in self._free:
            self._free.move_to_end(block_id)

    def pop(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        return block_id

    def own(self, block_id: int, owner: str | None, fresh: bool = False) -> None:
        pass

    def owners(self, block_id: int) -> tuple[str, ...]:
        return ()

    def unnamed(self, block_id: int) -> None:
        pass


class ProgramRanking(Protocol):
    """What the program-aware order knows of programs: each one's eviction key (higher is kept longer), and
    which programs' keys may have changed."""

    def eviction_key(self, program_id: str) -> tuple[EvictionKey, float]:
        """The program's key now, and the clock time until which it holds unless the program's record changes
        first (``inf``: until then)."""
        ...

    def now(self) -> float:
        """The clock the keys are read against."""
        ...

    def subscribe(self) -> Callable[[], set[str]]:
        """A feed of its own for one reader: each call returns the programs changed since the last one."""
        ...


class ChangeFeeds:
    """Fan-out of changed program ids: each reader subscribes once and gets its own feed, which returns the
    programs published since that reader last asked (what ``ProgramRanking.subscribe`` hands out)."""

    def __init__(self) -> None:
        self._pending: list[set[str]] = []

    def subscribe(self) -> Callable[[], set[str]]:
        pending: set[str] = set()
        self._pending.append(pending)

        def take() -> set[str]:
            out = set(pending)
            pending.clear()
            return out

        return take

    def publish(self, changed: Iterable[str]) -> None:
        changed = set(changed)
        if changed:
            for pending in self._pending:
                pending |= changed


class ProgramKeys:
    """The keys of the programs one reader follows, brought up to date when it asks (:meth:`catch_up`): those
    the ranking reports changed, and those whose key held until a time the clock has passed."""

    def __init__(self, ranking: ProgramRanking) -> None:
        self.ranking = ranking
        self._changed = ranking.subscribe()
        self._key: dict[str, EvictionKey] = {}
        self._until: dict[str, float] = {}  # program -> its deadline in the heap
        self._deadlines: list[tuple[float, str]] = []

    def __contains__(self, program: str) -> bool:
        return program in self._key

    def get(self, program: str) -> EvictionKey:
        """The program's key as last looked up; a program not followed yet is looked up and followed."""
        key = self._key.get(program)
        return self._look_up(program) if key is None else key

    def forget(self, program: str) -> None:
        self._key.pop(program, None)
        self._until.pop(program, None)

    def catch_up(self) -> list[str]:
        """Look up again every followed program that may have changed; returns those whose key did."""
        changed = self._changed()
        now = self.ranking.now()
        while self._deadlines and self._deadlines[0][0] <= now:
            until, program = heapq.heappop(self._deadlines)
            if self._until.get(program) == until:
                del self._until[program]
                changed.add(program)
        out = []
        for program in changed:
            old = self._key.get(program)
            if old is not None and self._look_up(program) != old:
                out.append(program)
        return out

    def _look_up(self, program: str) -> EvictionKey:
        key, until = self.ranking.eviction_key(program)
        self._key[program] = key
        if until < math.inf and self._until.get(program) != until:
            self._until[program] = until
            heapq.heappush(self._deadlines, (until, program))
        return key


def order_factory(ranking: ProgramRanking | None) -> Callable[[Iterable[int]], EvictionOrder]:
    """What builds a pool's eviction order: program-aware with a ranking, else LRU."""
    if ranking is None:
        return LRUOrder

    def program_aware(block_ids: Iterable[int]) -> EvictionOrder:
        return ProgramAwareOrder(block_ids, ranking)

    return program_aware


class ProgramAwareOrder:
    """Unnamed free blocks first, then named ones by their owners' eviction key, least recently used among
    equals (module docstring).

    One heap of (key, tick, block id), the tick counting frees and refreshes; a block re-keyed or revived
    leaves a stale entry behind, skipped when it comes up and cleared when the heap grows to twice its live
    entries. A program is followed (its key, its free blocks) while it owns a block of the pool.
    """

    keeps_owners = True

    def __init__(self, block_ids: Iterable[int], ranking: ProgramRanking) -> None:
        self.keys = ProgramKeys(ranking)
        self._tick = itertools.count()
        self._entry: dict[int, tuple[EvictionKey, int]] = {}  # free block -> (key, tick)
        self._heap: list[tuple[EvictionKey, int, int]] = []  # (key, tick, block id), with stale entries
        self._owners: dict[int, set[str]] = {}  # block -> the programs that own it (any block, free or not)
        self._named: set[int] = set()  # free blocks with a name
        self._free_of: dict[str, set[int]] = {}  # program -> its free named blocks
        self._num_owned: dict[str, int] = {}  # program -> blocks it owns here
        for block_id in block_ids:
            self._push(block_id, UNNAMED, next(self._tick))

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry

    def __iter__(self) -> Iterator[int]:
        return iter(self._entry)

    def add(self, block_id: int, named: bool) -> None:
        if named:
            self._catch_up()  # the key it joins with must be current
            self._named.add(block_id)
            for program in self._owners.get(block_id, ()):
                self._free_of.setdefault(program, set()).add(block_id)
        self._push(block_id, self._block_key(block_id), next(self._tick))

    def remove(self, block_id: int) -> None:
        self._drop_entry(block_id)

    def refresh(self, block_id: int, owner: str | None = None) -> None:
        self.own(block_id, owner)
        if block_id in self._entry:
            named = block_id in self._named
            self._drop_entry(block_id)
            self.add(block_id, named)

    def pop(self) -> int:
        self._catch_up()
        heap = self._heap
        while heap:
            key, tick, block_id = heapq.heappop(heap)
            if self._entry.get(block_id) == (key, tick):
                self._drop_entry(block_id)
                return block_id
        raise IndexError("no free block")

    def own(self, block_id: int, owner: str | None, fresh: bool = False) -> None:
        if fresh:
            for program in self._owners.pop(block_id, ()):
                self._disown(program, block_id)
        if owner is None:
            return
        owners = self._owners.setdefault(block_id, set())
        if owner in owners:
            return
        owners.add(owner)
        self._num_owned[owner] = self._num_owned.get(owner, 0) + 1
        self.keys.get(owner)  # followed from now on
        if block_id in self._named:  # free: its key may rise with its new owner
            self._free_of.setdefault(owner, set()).add(block_id)
            self._rekey(block_id)

    def owners(self, block_id: int) -> tuple[str, ...]:
        return tuple(self._owners.get(block_id, ()))

    def unnamed(self, block_id: int) -> None:
        if block_id in self._named:
            _, tick = self._drop_entry(block_id)
            self._push(block_id, UNNAMED, tick)

    def block_key(self, block_id: int) -> EvictionKey:
        """The key of a free block now, or of a block in use were it freed now (for tests and reports)."""
        self._catch_up()
        if block_id in self._entry:
            return self._entry[block_id][0]
        self._named.add(block_id)
        try:
            return self._block_key(block_id)
        finally:
            self._named.discard(block_id)

    # -- keys ---------------------------------------------------------------------------------------------

    def _block_key(self, block_id: int) -> EvictionKey:
        """A block's key from its owners' keys (the hottest owner's)."""
        if block_id not in self._named:
            return UNNAMED
        owners = self._owners.get(block_id)
        if not owners:
            return FINISHED
        keys = self.keys
        if len(owners) > PRUNE_OWNERS_ABOVE:
            for program in [p for p in owners if keys.get(p) == FINISHED][: len(owners) - 1]:
                owners.discard(program)
                self._disown(program, block_id)
        return max(keys.get(p) for p in owners)

    def _catch_up(self) -> None:
        """Re-key the free blocks of every program whose key changed since the last look."""
        for program in self.keys.catch_up():
            for block_id in list(self._free_of.get(program, ())):
                self._rekey(block_id)

    def _rekey(self, block_id: int) -> None:
        key, tick = self._entry[block_id]
        new = self._block_key(block_id)
        if new != key:
            del self._entry[block_id]
            self._push(block_id, new, tick)  # it keeps its tick: LRU among its new equals

    def _disown(self, program: str, block_id: int) -> None:
        blocks = self._free_of.get(program)
        if blocks is not None:
            blocks.discard(block_id)
        left = self._num_owned.get(program, 0) - 1
        if left > 0:
            self._num_owned[program] = left
        else:  # it owns nothing here any more: no longer followed (looked up afresh if it comes back)
            self._num_owned.pop(program, None)
            self._free_of.pop(program, None)
            self.keys.forget(program)

    def _drop_entry(self, block_id: int) -> tuple[EvictionKey, int]:
        entry = self._entry.pop(block_id)
        if block_id in self._named:
            self._named.discard(block_id)
            for program in self._owners.get(block_id, ()):
                blocks = self._free_of.get(program)
                if blocks is not None:
                    blocks.discard(block_id)
        return entry

    def _push(self, block_id: int, key: EvictionKey, tick: int) -> None:
        self._entry[block_id] = (key, tick)
        heapq.heappush(self._heap, (key, tick, block_id))
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = [(k, t, b) for k, t, b in self._heap if self._entry.get(b) == (k, t)]
            heapq.heapify(self._heap)
