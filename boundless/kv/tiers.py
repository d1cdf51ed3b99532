"""KV memory by tier: what the executor reads and writes when it applies a step's transfers.

A tier has two halves. Its bookkeeping (which blocks are free, which request holds which) is a block pool
in ``KVCacheManager``, on the scheduler's side; its memory is a :class:`KVTier` on the executor's side. Both
are keyed by the tier's id (``kv/transfer.py``), and a :class:`~boundless.kv.transfer.BlockTransfer` names
blocks of either. The device tier is ``PagedKVCache`` (``kv/tensors.py``); :class:`HostKVTier` is host
memory (pinned when the device is a GPU). Another instance's memory is one more implementation of
:class:`KVTier` with a pool of its own: the scheduler keeps emitting transfers.

The disk store is addressed by block name instead (:class:`BlockStore`, ``kv/disk_store.py``): it is
shared with other processes and outlives this one, so it has no pool of ours, and its reads and writes
run in the background (``kv/disk_moves.py``, ``kv/tier_io.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from boundless.kv.block_hash import BlockHash
from boundless.kv.cache_dtype import index_copy, index_select
from boundless.kv.tensors import PagedKVCache


class KVTier(Protocol):
    """KV memory addressed by block id. Blocks travel as [layers, 2, kv_heads, n, block_size, head_dim]."""

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of these blocks' KV across all layers, in the order given."""
        ...

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Store ``blocks`` (from any tier's device and dtype) as these blocks' KV."""
        ...


class BlockStore(Protocol):
    """KV blocks by name that outlive the process (the disk store). Blocks are [layers, 2, kv_heads,
    block_size, head_dim] each on the way out, stacked as [layers, 2, kv_heads, n, block_size, head_dim] on
    the way in. Read or I/O trouble never raises: a block that cannot be read comes back as None."""

    def contains(self, key: BlockHash) -> bool: ...

    def read(self, keys: Sequence[BlockHash]) -> list[torch.Tensor | None]: ...

    def write(self, keys: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        """Store ``blocks`` under ``keys``; returns how many were written."""
        ...

    def age(self, keys: Sequence[BlockHash], seconds: float) -> int:
        """Set these blocks' eviction stamps back by ``seconds``, so they go before blocks used since; returns
        how many it holds (program-aware eviction's hint: no live program uses them)."""
        ...

    def stats(self) -> object: ...

    # Optional: ``held_keys() -> list[BlockHash]``, the names the store holds, least recently used first.


class HostKVTier:
    """Host memory for ``num_blocks`` blocks shaped like ``device``'s (pinned when the device is a GPU)."""

    def __init__(self, device: PagedKVCache, num_blocks: int) -> None:
        shape = list(device.data.shape)
        shape[3] = num_blocks
        pin = device.data.device.type == "cuda"
        # Not zeroed: a host block is read only after a transfer wrote it, and untouched pages cost no memory, so
        # a large --kv-host-gb is paid for as it fills rather than at start-up.
        self.data = torch.empty(shape, dtype=device.data.dtype, pin_memory=pin)

    def release(self) -> None:
        """Give the tier's memory back (as ``PagedKVCache.release``)."""
        self.data = self.data.new_empty(0)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return index_select(self.data, 3, torch.as_tensor(list(block_ids), dtype=torch.long))

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        index_copy(self.data, 3, idx, blocks)
