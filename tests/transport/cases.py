"""Messages the transport tests exchange: odd sizes (multiples of nothing), bf16 and fp32, one tensor or
several, from a few bytes to past the shared-memory inline limit."""

from __future__ import annotations

import torch

from boundless.kv.cache_dtype import to_cache
from boundless.kv.tensors import PagedKVCache

# Each case is one message: a list of (shape, dtype).
CASES: list[list[tuple[tuple[int, ...], torch.dtype]]] = [
    [((7,), torch.bfloat16)],  # 14 bytes
    [((3, 5, 17), torch.float32)],
    [((1,), torch.float32)],
    [((2, 3, 5, 16, 8), torch.bfloat16), ((2, 3, 5, 16, 8), torch.bfloat16)],  # a layer's K and V, 5 blocks
    [((9, 64), torch.float32), ((9,), torch.float32), ((9,), torch.float32)],  # partials: o, m, e
    [((300_001,), torch.float32)],  # 1.2 MB: through the shared-memory slot
    [((1_000_003,), torch.bfloat16), ((13,), torch.float32)],
]


def make(case: list[tuple[tuple[int, ...], torch.dtype]], seed: int) -> list[torch.Tensor]:
    """Random values that use every bit pattern's high bits (so a byte lost or shifted shows)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 1e3).to(dtype) for shape, dtype in case]


def late(tag: int) -> torch.Tensor:
    return torch.full((50_000,), float(tag), dtype=torch.float32)


# A small KV cache both processes build alike: 2 layers, 3 KV heads, 10 blocks of 5 tokens, head_dim 8.
CACHE = {"num_layers": 2, "num_kv_heads": 3, "head_dim": 8, "num_blocks": 10, "block_size": 5}
SENT_BLOCKS, PEER_BLOCKS, BACK_BLOCKS = [7, 2, 4], [1, 8, 3], [0, 5, 9]
# The caches' types the blocks move in, in the order both processes take them (fp8: ``--kv-cache-dtype fp8``).
KV_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def kv_cache(dtype: torch.dtype, seed: int | None) -> PagedKVCache:
    cache = PagedKVCache(**CACHE, dtype=dtype, device=torch.device("cpu"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        cache.data.copy_(to_cache(torch.randn(cache.data.shape, generator=gen) * 1e3, dtype))
    return cache
