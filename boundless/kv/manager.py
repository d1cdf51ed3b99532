"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The scheduler talks to this class only; it never sees blocks, just whether slots could be
allocated and how many prompt tokens a prefix-cache hit saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.block_pool import BlockPool, KVBlock


@dataclass
class CachedPrefix:
    """Blocks found in the prefix cache for a request's leading tokens."""

    blocks: list[KVBlock] = field(default_factory=list)
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCacheManager:
    """Owns the block pool and every request's block table."""

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
        # Host memory for swapped-out requests: plain blocks, never shared or cached.
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks > 0 else None
        self._host_tables: dict[str, list[KVBlock]] = {}
        # Host blocks read by this step's swap-ins: free only once the step's copies are done, or a
        # swap-out in the same step could take one and overwrite it before it is read.
        self._host_releasing: list[KVBlock] = []
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

    def num_host_blocks(self, request_id: str) -> int:
        return len(self._host_tables.get(request_id, ()))

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
        host = self._host_tables.pop(request_id, [])
        if host and self.host_pool is not None:
            self.host_pool.free(host)
        self._hashes.pop(request_id, None)
        self._num_named.pop(request_id, None)

    # -- swapping to host memory ----------------------------------------------------------

    def begin_step(self) -> None:
        """Free the host blocks the last step's swap-ins read (their copies have run)."""
        if self._host_releasing and self.host_pool is not None:
            self.host_pool.free(self._host_releasing)
        self._host_releasing = []

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a request's KV to host blocks; returns (device, host) block pairs to copy, or None
        (changing nothing) when host memory lacks room. The device blocks are released."""
        table = self._tables.get(request_id)
        if not table or self.host_pool is None or self.host_pool.num_free < len(table):
            return None
        host = self.host_pool.allocate(len(table))
        pairs = [(d.block_id, h.block_id) for d, h in zip(table, host, strict=True)]
        self._host_tables[request_id] = host
        del self._tables[request_id]
        self.pool.free(reversed(table))
        self._num_named.pop(request_id, None)
        return pairs

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back; returns (host, device) pairs to copy, or None when device memory lacks room."""
        host = self._host_tables.get(request_id)
        assert host is not None and self.host_pool is not None
        if self.pool.num_free < len(host):
            return None
        device = self.pool.allocate(len(host))
        pairs = [(h.block_id, d.block_id) for h, d in zip(host, device, strict=True)]
        self._tables[request_id] = device
        del self._host_tables[request_id]
        self._host_releasing.extend(host)
        self._name_full_blocks(request_id, token_ids, num_computed)
        return pairs

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
