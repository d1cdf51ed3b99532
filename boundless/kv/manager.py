"""Per-request block tables on top of the tiers' block pools, with prefix-cache lookups.

The scheduler talks to this class only; it never touches blocks, just learns whether slots could be
allocated, how many prompt tokens a prefix-cache hit saves, and which transfers a swap takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.block_pool import BlockPool, KVBlock
from boundless.kv.transfer import DEVICE, HOST, BlockRef, BlockTransfer, TierId


@dataclass
class CachedPrefix:
    """Blocks found in the prefix cache for a request's leading tokens."""

    blocks: list[KVBlock] = field(default_factory=list)
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCacheManager:
    """Owns every tier's block pool and every request's block table.

    A request's KV sits in one tier: on the device while it can run, in a tier below (host memory) while it
    is swapped out. Moving it is bookkeeping here and a list of transfers for the executor to copy.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        fingerprint: str,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Every tier's pool, the device first, then the tiers a swap-out tries in turn. Below the device
        # blocks are plain: never shared or cached.
        self.pools: dict[TierId, BlockPool] = {DEVICE: self.pool}
        if num_host_blocks > 0:
            self.pools[HOST] = BlockPool(num_host_blocks, enable_caching=False)
        self._swapped: dict[str, tuple[TierId, list[KVBlock]]] = {}
        # Blocks below the device that this step's swap-ins read: freed only once the step's transfers are
        # done, or a swap-out in the same step could take one and overwrite it before it is read.
        self._read_this_step: list[tuple[TierId, list[KVBlock]]] = []
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_named: dict[str, int] = {}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_allocated_blocks(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request_id, [])
        return extend_block_hashes(hashes, token_ids, self.block_size, self.fingerprint)

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of leading full blocks already in the cache.

        At least one token is always left to compute, so the step that admits the request
        produces its next-token logits.
        """
        prefix = CachedPrefix(block_size=self.block_size)
        if not self.pool.enable_caching:
            return prefix
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self.block_hashes(request_id, token_ids)
        bs = self.block_size
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            prefix.blocks.append(block)
        return prefix

    def blocks_short(self, request_id: str, num_tokens_after: int, prefix: CachedPrefix | None = None) -> int:
        """How many more free blocks an allocation up to ``num_tokens_after`` tokens would need (<= 0: none)."""
        return self._blocks_short(request_id, num_tokens_after, prefix)

    def num_swapped_blocks(self, request_id: str) -> int:
        swapped = self._swapped.get(request_id)
        return len(swapped[1]) if swapped is not None else 0

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens_after: int,
        prefix: CachedPrefix | None = None,
    ) -> bool:
        """Make room for the request's KV up to ``num_tokens_after`` tokens.

        ``prefix`` (first allocation only) takes references on cache hits instead of new blocks.
        Returns False, changing nothing, when the pool lacks free blocks.
        """
        if self._blocks_short(request_id, num_tokens_after, prefix) > 0:
            return False
        table = self._tables.setdefault(request_id, [])
        if prefix is not None and prefix.blocks:
            assert not table, "a cached prefix is only taken on the first allocation"
            self.pool.touch(prefix.blocks)
            table.extend(prefix.blocks)
        num_new = self.blocks_for_tokens(num_tokens_after) - len(table)
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))
        self._name_full_blocks(request_id, token_ids, num_tokens_after)
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks (tail first, so its tail is evicted first) and forget it."""
        table = self._tables.pop(request_id, [])
        self.pool.free(reversed(table))
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            tier, blocks = swapped
            self.pools[tier].free(blocks)
        self._hashes.pop(request_id, None)
        self._num_named.pop(request_id, None)

    # -- moves between tiers ------------------------------------------------------------------

    def begin_step(self) -> None:
        """Free the blocks below the device that the last step's swap-ins read (their copies have run)."""
        for tier, blocks in self._read_this_step:
            self.pools[tier].free(blocks)
        self._read_this_step = []

    def swap_out(self, request_id: str) -> list[BlockTransfer] | None:
        """Move a request's KV to the first tier below the device with room; returns the transfers to
        copy, or None (changing nothing) when no tier has room. The device blocks are released."""
        table = self._tables.get(request_id)
        if not table:
            return None
        tier = next((t for t in list(self.pools)[1:] if self.pools[t].num_free >= len(table)), None)
        if tier is None:
            return None
        lower = self.pools[tier].allocate(len(table))
        transfers = [
            BlockTransfer(BlockRef(DEVICE, d.block_id), BlockRef(tier, b.block_id))
            for d, b in zip(table, lower, strict=True)
        ]
        self._swapped[request_id] = (tier, lower)
        del self._tables[request_id]
        self.pool.free(reversed(table))
        self._num_named.pop(request_id, None)
        return transfers

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> list[BlockTransfer] | None:
        """Bring a swapped request back to the device; returns the transfers to copy, or None when device
        memory lacks room."""
        tier, lower = self._swapped[request_id]
        if self.pool.num_free < len(lower):
            return None
        device = self.pool.allocate(len(lower))
        transfers = [
            BlockTransfer(BlockRef(tier, b.block_id), BlockRef(DEVICE, d.block_id))
            for b, d in zip(lower, device, strict=True)
        ]
        self._tables[request_id] = device
        del self._swapped[request_id]
        self._read_this_step.append((tier, lower))
        self._name_full_blocks(request_id, token_ids, num_computed)
        return transfers

    def holders(self, refs: Iterable[BlockRef]) -> list[str]:
        """The requests whose KV (on the device or swapped out) is in any of these blocks."""
        wanted = set(refs)
        tables = [(rid, DEVICE, t) for rid, t in self._tables.items()]
        tables += [(rid, tier, t) for rid, (tier, t) in self._swapped.items()]
        return [rid for rid, tier, table in tables if any(BlockRef(tier, b.block_id) in wanted for b in table)]

    def forget(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache names of these device blocks: their KV was never written."""
        self.pool.uncache(self.pool.blocks[i] for i in block_ids)

    def _blocks_short(self, request_id: str, num_tokens_after: int, prefix: CachedPrefix | None) -> int:
        have = len(self._tables.get(request_id, ()))
        reused = len(prefix.blocks) if prefix is not None else 0
        # Hits on free cached blocks leave the free queue, so they cost free capacity too.
        revived = sum(1 for b in prefix.blocks if b.ref_count == 0) if prefix is not None else 0
        need = self.blocks_for_tokens(num_tokens_after) - have - reused
        return max(need, 0) + revived - self.pool.num_free

    def _name_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        table = self._tables[request_id]
        start = self._num_named.get(request_id, 0)
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= start:
            return
        hashes = self.block_hashes(request_id, token_ids[: num_full * self.block_size])
        bs = self.block_size
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i], token_ids[i * bs : (i + 1) * bs])
        self._num_named[request_id] = num_full
