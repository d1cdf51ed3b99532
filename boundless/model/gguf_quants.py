"""GGUF block dequantization with PyTorch for the common block types, bit-identical with ``gguf``'s reference.

``gguf.quants.dequantize`` (the numpy code transformers uses) walks a tensor in small groups of rows and makes
several temporaries a group: the bundled SmolLM2 file (106 M Q4_1 and 28 M Q8_0 values) took 2 s of
``boundless serve``'s start-up. The same arithmetic over the whole tensor at once, in PyTorch's threaded kernels,
takes 0.45 s. Each value is computed with the reference's operations in the reference's order (a float16 scale
widened to float32, times the quant, plus the minimum), each rounded once, so the results are equal to the bit
(``tests/model/test_gguf_quants.py`` compares them). Other types go to the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte ``start`` of each block, widened to float32, as a column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # [d: f16][32 x int8]: d * q
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Each block's 16 bytes of 4-bit quants as 32 values: value i in the low nibble of byte i, 16 + i in the high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # [d: f16][16 bytes of nibbles]: d * (q - 8)
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # [d: f16][m: f16][16 bytes of nibbles]: d * q + m
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The float32 values of ``raw`` (rows of ``qtype`` blocks, as ``gguf.quants.dequantize`` takes them): a new
    array of shape ``raw.shape[:-1] + (values per row,)``, equal to the reference's."""
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        return reference_dequantize(raw, qtype).astype(np.float32, copy=False)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    *outer, row_bytes = raw.shape
    data = np.ascontiguousarray(raw, dtype=np.uint8)
    if not data.flags.writeable:  # a view of the file's read-only mapping, which torch will not wrap
        data = data.copy()
    blocks = torch.from_numpy(data).reshape(-1, block_bytes)
    values = kernel(blocks)
    return values.reshape(*outer, row_bytes // block_bytes * block_elems).numpy()
