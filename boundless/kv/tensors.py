"""The KV cache's memory: one tensor, preallocated once, addressed by block id."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from boundless.attention.backend import to_device
from boundless.kv.cache_dtype import index_copy, index_select
from boundless.native import huge_page_zeros


class PagedKVCache:
    """KV memory for every layer, shaped [layers, 2 (k, v), kv_heads, blocks, block_size, head_dim].

    Heads lead the block dimension so that gathering a batch's blocks for one head is a single
    ``index_select`` over contiguous rows, and a block's KV across all layers moves as one slice
    (for swapping to host memory or sending to another instance).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        if torch.device(device).type == "cpu":
            # On huge pages: attention reads scattered blocks, a TLB miss each on 4 KiB pages.
            numel = num_layers * 2 * num_kv_heads * num_blocks * block_size * head_dim
            self.data = huge_page_zeros(numel, dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        # Views made once: every layer of every step asks for its pair.
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    def release(self) -> None:
        """Give the pool's memory back (an engine closed for good, whose process builds another: a restart in place);
        the pool holds no block afterwards."""
        self.data = self.data.new_empty(0)
        self._layers = []

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key cache, value cache) of one layer, each [kv_heads, blocks, block_size, head_dim]."""
        return self._layers[index]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of these blocks' KV across all layers: [layers, 2, kv_heads, n, block_size, head_dim]."""
        return index_select(self.data, 3, self._index(block_ids))

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        index_copy(self.data, 3, self._index(block_ids), blocks)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        # (Copied in stream order: a copy queued behind a window still running does not wait for it.)
        return to_device(torch.tensor(list(block_ids), dtype=torch.long), self.data.device)
