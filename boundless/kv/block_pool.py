"""A fixed pool of KV blocks with reference counts and a prefix cache.

The pool is preallocated once (the tensors live with the runner; this class only does the
bookkeeping). A block is in one of three states:

- in use: ``ref_count > 0``; it belongs to one or more requests' block tables;
- cached and free: ``ref_count == 0`` with a name (``block_hash``); it sits in the free queue and
  can be revived by a prefix-cache hit until it is evicted;
- free: ``ref_count == 0`` and no name.

Free blocks wait in an eviction order (``kv/eviction.py``), which alone decides which one an allocation
takes: the least recently used (``LRUOrder``, the default) or by the programs that own them
(``ProgramAwareOrder``). Allocations, hits and refreshes say which program's request took the block
(``owner``), for the program-aware order. An eviction by allocation is reported to ``on_evict``, so that
the cache manager can move the block's KV down a tier before the block is overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import cast

from mypy_extensions import mypyc_attr

from boundless.kv.block_hash import BlockHash
from boundless.kv.events import MEDIUM_DEVICE, KVEventLog, LoraTag
from boundless.kv.eviction import EvictionOrder, LRUOrder


@mypyc_attr(native_class=False)  # (compiled, a class that derives from RuntimeError must stay a Python class)
class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


# Slots: a simulated cluster's pools hold millions of blocks (2.3 M at 1,152 engines), each with a dict otherwise.
@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # The tokens a named block holds; a hit checks them so a hash collision can never alias KV.
    token_ids: tuple[int, ...] | None = None


@dataclass
class BlockPoolStats:
    queries: int = 0  # blocks looked up in the prefix cache
    hits: int = 0  # of which were found
    evictions: int = 0  # cached blocks whose name was dropped to reuse them


# Told of a named block an allocation is about to reuse: the block (its KV still intact), its name and tokens.
EvictionHook = Callable[[KVBlock, BlockHash, tuple[int, ...]], None]


# Builds a pool's eviction order over its block ids (all free at first).
OrderFactory = Callable[[Iterable[int]], EvictionOrder]


class BlockPool:
    """Bookkeeping for ``num_blocks`` KV blocks: allocation, sharing, prefix cache, eviction (LRU unless
    ``order`` builds another eviction order)."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: EvictionHook | None = None,
        order: OrderFactory = LRUOrder,
        medium: str = MEDIUM_DEVICE,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        # The blocks handed out so far, by id: a block is made when it is first allocated (every order hands fresh
        # ids out in turn), so a pool costs what it holds. Made at once, a small model's default pools (2 GiB of
        # device KV at 8 KiB a block, 262 K blocks) took 0.8 s to start.
        self.blocks: list[KVBlock] = []
        self._free: EvictionOrder = order(range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.stats = BlockPoolStats()
        # Where names given and dropped are told (``kv/events.py``), as the tier ``medium``; None: nowhere, and no
        # event is made.
        self.events: KVEventLog | None = None
        self.medium = medium

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def order(self) -> EvictionOrder:
        """The free blocks, in the order allocations take them."""
        return self._free

    def allocate(self, n: int, owner: str | None = None, keep_evicted: bool = True) -> list[KVBlock]:
        """Take ``n`` blocks in the eviction order's turn, evicting their names; ``owner``'s program holds them.
        ``keep_evicted=False``: evicted blocks are not reported to ``on_evict`` (their KV is not kept below)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        blocks = self.blocks  # (looked up once: a hot loop)
        on_evict = self.on_evict if keep_evicted else None
        pop, own = self._free.pop, self._free.own if self._free.keeps_owners else None
        for _ in range(n):
            block_id = pop()
            try:
                block = blocks[block_id]
            except IndexError:  # never handed out before
                block = self._make(block_id)
            block.ref_count = 1
            if block.block_hash is not None:
                name, tokens = block.block_hash, block.token_ids
                self._evict(block)
                if on_evict is not None:
                    assert tokens is not None
                    on_evict(block, name, tokens)  # while the order still knows who owned it
            if own is not None:
                own(block.block_id, owner, True)  # fresh: whoever owned it before no longer does
            out.append(block)
        return out

    def _make(self, block_id: int) -> KVBlock:
        """Make the blocks up to ``block_id`` (the ids before it too, should an order hand ids out of turn), and as
        many more as there were (within the pool): made by doubling, an allocation that hands out fresh ids in turn
        comes here (by an exception) a few times, not once a block."""
        blocks = self.blocks
        blocks.extend(map(KVBlock, range(len(blocks), max(block_id + 1, min(self.num_blocks, 2 * len(blocks))))))
        return blocks[block_id]

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this name and these tokens, or None. Does not take a reference."""
        if not self.enable_caching:
            return None
        self.stats.queries += 1
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        self.stats.hits += 1
        return block

    def named_blocks(self) -> list[tuple[BlockHash, KVBlock]]:
        """Every block with a name in the prefix cache, with its name."""
        return list(self._cached.items())

    def peek(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """As :meth:`lookup`, without counting a query (for moves between tiers, not prefix lookups)."""
        block = self._cached.get(block_hash)
        return block if block is not None and block.token_ids == tuple(token_ids) else None

    def refresh(self, block: KVBlock, owner: str | None = None) -> None:
        """Mark a cached block as just used (by ``owner``'s program): if free, it is the last of its equals to go."""
        self._free.refresh(block.block_id, owner)

    def touch(self, blocks: Iterable[KVBlock], owner: str | None = None) -> None:
        """Take a reference (for ``owner``'s program) on blocks found by :meth:`lookup`, reviving them if free."""
        remove, own = self._free.remove, self._free.own if self._free.keeps_owners else None
        for block in blocks:
            if block.ref_count == 0:
                remove(block.block_id)
            block.ref_count += 1
            if own is not None:
                own(block.block_id, owner)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks that reach zero join the free queue's tail.

        Callers pass a request's blocks tail first, so that its last blocks (least likely to be
        shared) are evicted before its first ones.
        """
        add = self._free.add
        for block in blocks:
            left = block.ref_count - 1
            if left < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_count = left
            if left == 0:
                add(block.block_id, block.block_hash is not None)  # named

    def cache(
        self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int], parent: BlockHash | None = None
    ) -> None:
        """Name a full block so later requests can share it (``parent``: the name of the block before it, for the
        events)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another block already holds the same content; keep that one as the canonical copy.
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(self.medium, (block_hash,), parent, (block.token_ids,))

    def cache_run(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[BlockHash],
        block_tokens: Sequence[tuple[int, ...]],
        first: int,
        lora: LoraTag | None = None,
    ) -> None:
        """Name a run of full blocks: ``blocks[j]`` is block ``i = first + j`` of a token sequence, named ``hashes[i]``,
        with tokens ``block_tokens[i]`` (kept as they are: the tuple is shared); :meth:`cache` of each in turn (a
        request's new full blocks in one call; ``lora``: the adapter that computes them, for the events)."""
        if not self.enable_caching:
            return
        cached, i = self._cached, first
        named: list[int] | None = [] if self.events is not None else None
        for block in blocks:
            name = hashes[i]
            if block.block_hash is None and name not in cached:
                block.block_hash = name
                block.token_ids = block_tokens[i]
                cached[name] = block
                if named is not None:
                    named.append(i)
            i += 1
        if named:
            self._report_runs(named, hashes, block_tokens, lora)

    def _report_runs(
        self,
        named: list[int],
        hashes: Sequence[BlockHash],
        block_tokens: Sequence[tuple[int, ...]],
        lora: LoraTag | None,
    ) -> None:
        """One stored event per run of consecutive blocks named (a block another already holds breaks a run)."""
        assert self.events is not None
        start = prev = named[0]
        for i in [*named[1:], -1]:
            if i != prev + 1:
                parent = hashes[start - 1] if start > 0 else None
                self.events.stored(self.medium, hashes[start : prev + 1], parent, block_tokens[start : prev + 1], lora)
                start = i
            prev = i

    def reset_prefix_cache(self) -> None:
        """Drop every name (told as one ``AllBlocksCleared`` by the cache manager, not block by block)."""
        events, self.events = self.events, None
        for block in list(self._cached.values()):
            self._evict(block)
        self.events = events

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Drop these blocks' names (those that have one), so no lookup finds them again."""
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.removed(self.medium, block.block_hash)
        block.block_hash = None
        block.token_ids = None
        self.stats.evictions += 1
        if block.ref_count == 0:
            self._free.unnamed(block.block_id)

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests)."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free)
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in free_ids), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
        for h, block in self._cached.items():
            assert block.block_hash == h


_token_ids = attrgetter("token_ids")


def find_run(
    pools: Sequence[BlockPool],
    hashes: Sequence[BlockHash],
    block_tokens: Sequence[tuple[int, ...]],
    first: int,
    end: int,
    count: bool = False,
) -> tuple[list[KVBlock], list[int]]:
    """The leading run of blocks ``first`` to ``end`` of a token sequence (block ``i`` named ``hashes[i]``, with tokens
    ``block_tokens[i]``) that the pools hold, each from the first pool holding it: the blocks, and the index in
    ``pools`` of each one's pool. What :meth:`BlockPool.peek` of each block in each pool in turn finds, up to the first
    block none holds; ``count``: :meth:`BlockPool.lookup`'s, counted alike (a query in each pool tried, a hit in the
    one that held it). One call for a prompt's prefix, in memory tiers tried in order."""
    # (A lookup in a pool without caching finds nothing and counts nothing.)
    caches = [pool._cached if pool.enable_caching or not count else {} for pool in pools]
    # Most of a prefix is in the first pool (the device): its leading run there is found at once, the names looked up
    # by map and the tokens compared as lists (a block named by a request holds that request's tuple), then the rest
    # block by block.
    found: list[KVBlock | None] = list(map(caches[0].get, hashes[first:end])) if caches else []
    head = found.index(None) if None in found else len(found)
    blocks = cast("list[KVBlock]", found[:head])  # (no None before ``head``)
    if head and list(map(_token_ids, blocks)) != block_tokens[first : first + head]:
        head = next((j for j in range(head) if blocks[j].token_ids != block_tokens[first + j]), head)
        del blocks[head:]
    where: list[int] = [0] * head
    missed = False  # whether the run ended at a block no pool holds (every pool was asked for it)
    for i in range(first + head, end):
        name, tokens = hashes[i], block_tokens[i]
        for k, cached in enumerate(caches):
            block = cached.get(name)
            # The tokens are checked (a name's collision is not this block); a block named by the same request
            # holds the very same tuple.
            if block is not None and (block.token_ids is tokens or block.token_ids == tokens):
                blocks.append(block)
                where.append(k)
                break
        else:
            missed = True
            break
    if count:
        # Pool k was asked for each block found in it or a pool after it, and for the block that ended the run.
        asked = len(where) + missed
        for k, pool in enumerate(pools):
            hits = where.count(k)
            if pool.enable_caching:
                pool.stats.queries += asked
                pool.stats.hits += hits
            asked -= hits
    return blocks, where


def find_held(
    pools: Sequence[BlockPool],
    hashes: Sequence[BlockHash],
    block_tokens: Sequence[tuple[int, ...]],
    first: int,
    end: int,
) -> int:
    """The first of blocks ``first`` to ``end`` (as in :func:`find_run`) that some pool holds (:meth:`BlockPool.peek`);
    ``end`` when none does: where a run of blocks missing from memory ends."""
    caches = [pool._cached for pool in pools]
    for i in range(first, end):
        name, tokens = hashes[i], block_tokens[i]
        for cached in caches:
            block = cached.get(name)
            if block is not None and (block.token_ids is tokens or block.token_ids == tokens):
                return i
    return end
