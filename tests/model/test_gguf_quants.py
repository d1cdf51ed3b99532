"""The PyTorch dequantization of GGUF blocks against ``gguf``'s reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference

from boundless.model.gguf_quants import _KERNELS, dequantize

Q = GGMLQuantizationType


def _random_rows(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Rows of random blocks: random bytes (every nibble and int8), scales drawn as float16 of any size and sign."""
    rng = np.random.default_rng(seed)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    *outer, blocks_per_row = shape
    raw = rng.integers(0, 256, size=(*outer, blocks_per_row, block_bytes), dtype=np.uint8)
    # Scales (and Q4_1's minimum) as finite float16s from tiny to large, so the products round in every way.
    size = (*outer, blocks_per_row, 2)
    halves = rng.standard_normal(size) * 10.0 ** rng.integers(-6, 4, size)
    scales = halves.astype(np.float16).view(np.uint8).reshape(*outer, blocks_per_row, 4)
    raw[..., :2] = scales[..., :2]
    if qtype == Q.Q4_1:
        raw[..., 2:4] = scales[..., 2:4]
    return raw.reshape(*outer, blocks_per_row * block_bytes)


@pytest.mark.parametrize("qtype", sorted(_KERNELS, key=lambda q: q.value), ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(3, 4), (2, 5, 2), (1, 1)])
def test_each_kernel_gives_the_references_bits(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    raw = _random_rows(qtype, shape, seed=sum(shape) + qtype.value)
    ours, theirs = dequantize(raw, qtype), reference(raw, qtype).astype(np.float32)
    values_per_row = shape[-1] * GGML_QUANT_SIZES[qtype][0]
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (*shape[:-1], values_per_row)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_read_only_input_and_other_types_go_through() -> None:
    raw = _random_rows(Q.Q4_1, (2, 3), seed=1)
    raw.flags.writeable = False  # as the file's mapping is
    assert np.array_equal(dequantize(raw, Q.Q4_1), reference(raw, Q.Q4_1))
    # A type with no kernel here is the reference's own result.
    f16 = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float16).view(np.uint8)
    assert np.array_equal(dequantize(f16, Q.F16), reference(f16, Q.F16).astype(np.float32))
