"""A GPTQ or AWQ checkpoint's matrices held in their 4 or 8 bits a weight (vLLM's W4A16: the weights read as stored,
the activations in the model's type).

``model/packed_int.py`` reads each packed layer; held as stored (on a GPU with Triton, one rank: the loader's
``quantized_dense`` and ``quantized_experts``), a matrix ``[out, in]`` is laid out as :class:`IntStack` lays a stack
of them out (a model's dense matrices one a stack, a mixture's experts one a matrix), its rows in the model's order so
that q's, k's and v's (gate's and up's) stack as their rows do:

- ``codes``: uint8 ``[..., out, in * bits / 8]``; in 4 bits input ``2i`` the low nibble of byte ``i``, ``2i + 1`` its
  high one (GPTQ's own order: its int32s, transposed, are these bytes); in 8 bits a byte an input;
- ``scales``: ``[..., out, groups]`` fp32 (exactly the checkpoint's fp16); ``zeros``: uint8, each group's zero point;

and ``weight[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g]`` for input ``i`` of group ``g = i // group``, in fp32
(what ``PackedIntCheckpoint.weight`` computes), then the activations' type. A 4-bit 72B model then takes ~43 GB,
where held in bfloat16 it took ~145.

The products are the experts' kernel's (``fused_moe``: a dense matrix is a mixture of one expert every row chose):
a tile of codes dequantized in registers, exactly as above, the values rounded once to the activations' type, and in
4 bits the even inputs multiplied by the low nibbles and the odd ones by the high ones apart, as MXFP4's are.
Elsewhere a matrix is dequantized: once, packed for the native CPU kernel, or for each product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IntStack:
    """A stack of matrices [experts, out, in] held in ``bits`` (4 or 8) a weight with a scale and a zero point a
    ``group`` of inputs (the module docstring's layout: ``codes`` [experts, out, in * bits / 8], ``scales`` fp32 and
    ``zeros`` uint8 [experts, out, in / group])."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, out, width = self.codes.shape
        return experts, out, width * 8 // self.bits

    def dequantized(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Matrix ``index`` of the stack [out, in] in ``dtype``: ``(code - zero) * scale`` in fp32, rounded once."""
        codes = self.codes[index]
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
        groups = torch.arange(codes.shape[-1], device=codes.device) // self.group
        values = (codes.to(torch.int32) - self.zeros[index][:, groups].to(torch.int32)).to(torch.float32)
        return (values * self.scales[index][:, groups].to(torch.float32)).to(dtype)
