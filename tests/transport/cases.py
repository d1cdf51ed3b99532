"""Messages the transport tests exchange: odd sizes (multiples of nothing), bf16 and fp32, one tensor or
several, from a few bytes to past the shared-memory inline limit."""

from __future__ import annotations

import torch

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
