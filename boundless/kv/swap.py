"""Host memory for KV blocks of swapped-out requests, and the copies in and out of it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from boundless.kv.tensors import PagedKVCache


class HostSwapSpace:
    """A block pool's worth of KV memory on the host (pinned when the device is a GPU)."""

    def __init__(self, device_cache: PagedKVCache, num_blocks: int) -> None:
        self.device_cache = device_cache
        shape = list(device_cache.data.shape)
        shape[3] = num_blocks
        pin = device_cache.data.device.type == "cuda"
        self.data = torch.zeros(shape, dtype=device_cache.data.dtype, pin_memory=pin)

    def apply(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy (device, host) pairs out, then (host, device) pairs in.

        Out before in: a device block released by a swap-out may be the destination of a swap-in
        scheduled in the same step. (The other way round cannot happen: host blocks a swap-in
        reads stay taken until the next step, see ``KVCacheManager.begin_step``.)
        """
        if swap_out:
            device_ids = [d for d, _ in swap_out]
            host_ids = torch.tensor([h for _, h in swap_out], dtype=torch.long)
            self.data.index_copy_(3, host_ids, self.device_cache.read_blocks(device_ids).to("cpu"))
        if swap_in:
            host_ids = torch.tensor([h for h, _ in swap_in], dtype=torch.long)
            self.device_cache.write_blocks([d for _, d in swap_in], self.data.index_select(3, host_ids))
