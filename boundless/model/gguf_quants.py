"""GGUF block dequantization with PyTorch for the common block types, bit-identical with ``gguf``'s reference.

``gguf.quants.dequantize`` (the numpy code transformers uses) walks a tensor in small groups of rows and makes
several temporaries a group: the bundled SmolLM2 file (106 M Q4_1 and 28 M Q8_0 values) took 2 s of
``boundless serve``'s start-up. The same arithmetic over the whole tensor at once, in PyTorch's threaded kernels,
takes 0.45 s. Each value is computed with the reference's operations in the reference's order (a float16 scale
widened to float32, times the quant, plus the minimum), each rounded once, so the results are equal to the bit
(``tests/model/test_gguf_quants.py`` compares them). MXFP4 (gpt-oss's experts) too: the reference's table lookups
over a 20B model's 19 G expert values are its slowest part. Other types go to the reference. A tensor is taken
``_CHUNK_BLOCKS`` blocks at a time, so its temporaries (the lookups' int64 indices are twice the float32 output) stay a
few megabytes whatever its size.
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


# e2m1's sixteen values doubled, by their four bits (the reference's ``kvalues``: whole numbers, so -0 is 0): they are
# multiplied by half the block's power of two.
_E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Half of ``2 ** (e - 127)`` for each e8m0 exponent byte, as a float32 column: the bits ggml's
    ``ggml_e8m0_to_fp32_half`` builds (a subnormal for exponents 0 and 1)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # [e: e8m0][16 bytes of e2m1 nibbles]: half of 2 ** (e - 127) times the doubled value. (Exact: a power of two
    # times a small integer.)
    return _e8m0_half(blocks[:, :1]) * _E2M1_DOUBLED[_nibbles(blocks[:, 1:]).long()]


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.MXFP4: _mxfp4,
}
# Blocks dequantized at once: each kernel's temporaries are a few times the 4 MiB of float32 values of this many
# Q8_0 or MXFP4 blocks, rather than a few times a whole expert tensor's gigabyte.
_CHUNK_BLOCKS = 1 << 15


# Block types whose values are ``(code - zero) * d``, a whole zero point a block of 32 (``int_stack.IntStack``'s form),
# by the bits a code takes: Q8_0's signed bytes (moved by 128) and Q4_0's nibbles (less 8).
HELD_BITS = {GGMLQuantizationType.Q8_0: 8, GGMLQuantizationType.Q4_0: 4}
HELD_GROUP = 32


def held_codes(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``qtype`` blocks (:data:`HELD_BITS`) as ``IntStack`` holds a matrix: codes uint8 ``[rows, in * bits /
    8]`` (4 bits: input ``2i`` the low nibble of byte ``i``), scales fp32 and zero points uint8 ``[rows, in / 32]``,
    whose ``(code - zero) * scale`` is :func:`dequantize`'s value to the bit (a whole number times the float16 ``d``
    widened: exact in fp32)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).copy()).reshape(rows, -1, block_bytes)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).float().reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q8_0:
        codes = (blocks[:, :, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        zero = 128
    else:  # Q4_0: value i the low nibble of byte i, 16 + i its high one; paired here by neighbours
        values = torch.cat([blocks[:, :, 2:] & 0x0F, blocks[:, :, 2:] >> 4], dim=2)
        codes, zero = values[:, :, 0::2] | (values[:, :, 1::2] << 4), 8
    zeros = torch.full(scales.shape, zero, dtype=torch.uint8)
    return codes.reshape(rows, -1).contiguous(), scales.contiguous(), zeros


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
    values = torch.empty(blocks.shape[0], block_elems, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):  # (each value depends on its own block alone)
        values[start : start + _CHUNK_BLOCKS] = kernel(blocks[start : start + _CHUNK_BLOCKS])
    return values.reshape(*outer, row_bytes // block_bytes * block_elems).numpy()
