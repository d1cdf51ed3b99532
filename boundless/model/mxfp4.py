"""MXFP4 checkpoints (gpt-oss's, ``quant_method: mxfp4``): 4-bit floats in blocks of 32 with a power-of-two scale a
block, the OCP microscaling format, brought back to a float type as they stream in.

The Hub's gpt-oss files hold each stacked expert matrix as ``W_blocks`` (uint8 [experts, out, in / 32, 16]: two
e2m1 values a byte, the low nibble first) and ``W_scales`` (uint8 [experts, out, in / 32]: an e8m0 exponent, biased
by 127); everything else (attention, the router, embeddings, the head) is unquantized. Each pair becomes the tensor
``W`` as transformers' dequantization gives it, [experts, in, out], so the model loads such a checkpoint and a
dequantized one alike. The values are exact in bfloat16 (two significant bits times a power of two), which holds them
at half fp32's memory. On the GPU path the experts are held as the blocks and scales themselves
(``SparseMoE.hold_mxfp4``, a quarter of bfloat16's bytes), which the fused experts' kernel reads and dequantizes tile
by tile (``model/fused_moe.py``); elsewhere they are held dequantized in the model's type.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# e2m1's sixteen values by their four bits: sign, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks`` (uint8 [..., groups, 16]) times their ``scales`` (uint8 [..., groups]) as floats [..., groups * 32]:
    each byte's low nibble then its high one, each block of 32 times ``2 ** (scale - 127)``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match their scales {tuple(scales.shape)}")
    table = _e2m1_table(blocks.device)
    values = torch.stack([table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]], dim=-1).flatten(-2)
    # (In fp32, then cast: exact in bfloat16 and fp32, where the values fit; float16's 2 ** 16 would overflow first.)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """:data:`E2M1_VALUES` in fp32 on ``device``, made once (an expert is dequantized each time a step chooses it on
    the paths that hold MXFP4 experts without the kernels)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class Mxfp4Stack:
    """A stack of matrices [experts, out, in] held in MXFP4: ``blocks`` uint8 [experts, out, in / 32, 16] and
    ``scales`` uint8 [experts, out, in / 32]."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, out, groups = self.scales.shape
        return experts, out, groups * 32

    def dequantized(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Matrix ``index`` of the stack [out, in] in ``dtype``."""
        return dequantize_mxfp4(self.blocks[index], self.scales[index], dtype)


class Mxfp4Checkpoint:
    """A checkpoint whose config says ``quant_method: mxfp4``: its weights with each blocks/scales pair dequantized."""

    method = "mxfp4"

    def dequantized(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each ``W_blocks`` and ``W_scales`` pair (in either order, in any files) as ``W``, in
        transformers' layout of the dequantized tensor (its last two dimensions swapped: [..., in, out])."""
        waiting: dict[str, tuple[str, torch.Tensor]] = {}  # W -> the half of its pair seen first
        for name, tensor in weights:
            suffix = next((s for s in (_BLOCKS, _SCALES) if name.endswith(s)), None)
            if suffix is None:
                yield name, tensor
                continue
            key = name.removesuffix(suffix)
            other = waiting.pop(key, None)
            if other is None:
                waiting[key] = (suffix, tensor)
                continue
            blocks, scales = (tensor, other[1]) if suffix == _BLOCKS else (other[1], tensor)
            yield key, dequantize_mxfp4(blocks, scales).transpose(-1, -2)
        if waiting:
            raise ValueError(f"MXFP4 blocks without their scales (or scales without blocks): {sorted(waiting)[:3]}")
