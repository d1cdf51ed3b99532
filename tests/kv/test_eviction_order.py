"""The eviction orders of a block pool, as pure units: which free block an allocation takes.

The program-aware order is driven by a ranking stub: each program's key, a clock, and a feed of changes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from boundless.kv.block_hash import hash_block
from boundless.kv.block_pool import BlockPool
from boundless.kv.eviction import FINISHED, UNNAMED, ChangeFeeds, EvictionKey, LRUOrder, ProgramAwareOrder


class StubRanking:
    """Keys set by the test; ``change`` reports a program changed, as the process table would."""

    def __init__(self, keys: dict[str, EvictionKey] | None = None) -> None:
        self.keys = dict(keys or {})
        self.until: dict[str, float] = {}
        self.clock = 0.0
        self.lookups = 0
        self._feeds = ChangeFeeds()

    def eviction_key(self, program_id: str) -> tuple[EvictionKey, float]:
        self.lookups += 1
        until = self.until.get(program_id, math.inf)
        if self.clock >= until:
            return FINISHED, math.inf
        return self.keys.get(program_id, FINISHED), until

    def now(self) -> float:
        return self.clock

    def subscribe(self) -> Callable[[], set[str]]:
        return self._feeds.subscribe()

    def change(self, program: str, key: EvictionKey) -> None:
        self.keys[program] = key
        self._feeds.publish([program])


HOT, WARM, COLD = (1.0, 0.0), (1.0, -1.0), (1.0, -2.0)  # served next, later, last


def _pool(ranking: StubRanking, n: int) -> BlockPool:
    return BlockPool(n, order=lambda ids: ProgramAwareOrder(ids, ranking))


def _cached(pool: BlockPool, program: str, count: int, seed: int) -> list[int]:
    """``count`` blocks named and freed by ``program`` (tail first, as a request frees them); their ids."""
    blocks = pool.allocate(count, owner=program)
    for i, block in enumerate(blocks):
        tokens = (seed, i)
        pool.cache(block, hash_block(None, tokens, "fp"), tokens)
    pool.free(reversed(blocks))
    return [b.block_id for b in blocks]


def _taken(pool: BlockPool, n: int) -> list[int]:
    return [b.block_id for b in pool.allocate(n)]


def test_unnamed_blocks_go_before_any_named_one() -> None:
    ranking = StubRanking({"a": COLD})
    pool = _pool(ranking, 6)
    named = _cached(pool, "a", 3, seed=1)
    unnamed = pool.allocate(1, owner="a")
    pool.free(unnamed)  # freed last (the most recently used), but it holds no name
    # The never-used blocks and that one (LRU among unnamed), then the named, their tail first.
    assert _taken(pool, 6) == [4, 5, unnamed[0].block_id, *named[::-1]]


def test_finished_programs_go_first_then_the_last_served_then_the_hot() -> None:
    ranking = StubRanking({"hot": HOT, "warm": WARM, "cold": COLD, "done": COLD})
    pool = _pool(ranking, 8)
    hot = _cached(pool, "hot", 2, seed=1)
    done = _cached(pool, "done", 2, seed=2)
    warm = _cached(pool, "warm", 2, seed=3)
    cold = _cached(pool, "cold", 2, seed=4)
    ranking.change("done", FINISHED)
    # Tail blocks first within a program (least recently used: a request frees its tail first).
    assert _taken(pool, 8) == done[::-1] + cold[::-1] + warm[::-1] + hot[::-1]


def test_lru_among_equals() -> None:
    ranking = StubRanking({"a": WARM, "b": WARM})
    pool = _pool(ranking, 4)
    a1 = _cached(pool, "a", 1, seed=1)
    b = _cached(pool, "b", 2, seed=2)
    a2 = _cached(pool, "a", 1, seed=3)
    pool.refresh(pool.blocks[a1[0]])  # used again: the last of its equals to go
    assert _taken(pool, 4) == b[::-1] + a2 + a1


def test_with_every_program_equal_it_is_lru_over_named_blocks() -> None:
    ranking = StubRanking({p: WARM for p in "abc"})
    lru, aware = BlockPool(12), _pool(ranking, 12)
    for pool in (lru, aware):  # name every block first, so that only the order of use differs
        _cached(pool, "a", 12, seed=0)
    for step in range(300):  # the same hits and refreshes on both pools
        r = random.Random(step)
        action, block_id, program = r.random(), r.randrange(12), r.choice("abc")
        for pool in (lru, aware):
            block = pool.blocks[block_id]
            if action < 0.5:
                pool.touch([block], owner=program)
                pool.free([block])
            else:
                pool.refresh(block, owner=program)
    assert _taken(aware, 12) == _taken(lru, 12)


def test_a_shared_block_belongs_to_the_hottest_of_its_programs() -> None:
    ranking = StubRanking({"cold": COLD, "hot": HOT})
    pool = _pool(ranking, 4)
    shared = _cached(pool, "cold", 1, seed=1)
    pool.touch([pool.blocks[shared[0]]], owner="hot")  # a hit by another program
    pool.free([pool.blocks[shared[0]]])
    cold_only = _cached(pool, "cold", 1, seed=2)
    pool.allocate(2)  # the two never used
    assert pool.order.block_key(shared[0]) == HOT
    assert _taken(pool, 2) == cold_only + shared
    # When the hot program finishes, the shared block falls with it.
    ranking2 = StubRanking({"cold": COLD, "hot": HOT})
    pool2 = _pool(ranking2, 3)
    shared2 = _cached(pool2, "cold", 1, seed=1)
    pool2.touch([pool2.blocks[shared2[0]]], owner="hot")
    pool2.free([pool2.blocks[shared2[0]]])
    other = _cached(pool2, "cold", 1, seed=2)
    ranking2.change("hot", FINISHED)
    ranking2.change("cold", FINISHED)
    pool2.allocate(1)
    assert pool2.order.block_key(shared2[0]) == FINISHED
    assert _taken(pool2, 2) == shared2 + other  # LRU among the finished


def test_a_program_rekeyed_keeps_its_blocks_lru_place_among_new_equals() -> None:
    ranking = StubRanking({"a": HOT, "b": WARM})
    pool = _pool(ranking, 4)
    a = _cached(pool, "a", 2, seed=1)  # used before b's
    b = _cached(pool, "b", 2, seed=2)
    ranking.change("a", WARM)
    assert _taken(pool, 4) == a[::-1] + b[::-1]


def test_an_idle_program_falls_to_finished_when_the_clock_passes_its_deadline() -> None:
    ranking = StubRanking({"idle": HOT, "busy": WARM})
    ranking.until["idle"] = 10.0  # idle: its key holds until then, with no change reported
    pool = _pool(ranking, 4)
    idle = _cached(pool, "idle", 2, seed=1)
    busy = _cached(pool, "busy", 2, seed=2)
    assert pool.order.block_key(idle[0]) == HOT
    ranking.clock = 10.0
    assert _taken(pool, 4) == idle[::-1] + busy[::-1]


def test_only_programs_that_changed_are_looked_up_again() -> None:
    ranking = StubRanking({f"p{i}": WARM for i in range(50)})
    pool = _pool(ranking, 200)
    for i in range(50):
        _cached(pool, f"p{i}", 2, seed=i)
    before = ranking.lookups
    pool.allocate(100)  # the unnamed ones, then named: no program changed
    ranking.change("p7", FINISHED)
    pool.allocate(2)
    assert ranking.lookups - before == 1


def test_blocks_unnamed_while_free_go_first() -> None:
    ranking = StubRanking({"a": HOT})
    pool = _pool(ranking, 2)
    ids = _cached(pool, "a", 2, seed=1)
    pool.uncache([pool.blocks[ids[0]]])
    assert pool.order.block_key(ids[0]) == UNNAMED
    assert _taken(pool, 1) == [ids[0]]


def test_lru_order_is_the_free_queue() -> None:
    order = LRUOrder(range(3))
    order.remove(1)
    order.add(1, named=True)
    order.refresh(0)
    assert [order.pop() for _ in range(3)] == [2, 1, 0]
