"""GPTQ's and AWQ's matrices held in their bits (``model/int_linear.py``): the Triton kernel's products against the
matrix dequantized, in Triton's interpreter on the CPU (fp32 and fp16: the interpreter's bfloat16 products are
wrong, so bfloat16 runs on CUDA only). The checkpoints' layouts and the models held so:
``tests/model/test_packed_int.py``."""

from __future__ import annotations

import os

import pytest
import torch

from boundless.model.int_linear import IntMatrix, int_linear

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

DEVICE = torch.device(os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu"))
_TRITON_RUNS = triton is not None and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _matrix(out: int, inputs: int, bits: int, group: int, seed: int) -> IntMatrix:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out, inputs * bits // 8), generator=g, dtype=torch.uint8)
    groups = inputs // group
    scales = (torch.rand(out, groups, generator=g) * 0.01 + 0.001).half().float()
    zeros = torch.randint(0, 1 << bits, (out, groups), generator=g, dtype=torch.uint8)
    return IntMatrix(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), bits, group)


def test_dequantized_codes_are_the_low_nibble_first() -> None:
    """In 4 bits byte ``i`` holds input ``2i`` in its low nibble, ``2i + 1`` in its high one; each input's group is
    its position's; ``(code - zero) * scale``."""
    codes = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)  # (inputs 1, 2, 3, 4)
    matrix = IntMatrix(codes, torch.tensor([[0.5, 2.0]]), torch.tensor([[1, 3]], dtype=torch.uint8), 4, 2)
    assert matrix.inputs == 4
    assert matrix.dequantized(torch.float32).tolist() == [[0.0, 0.5, 0.0, 2.0]]
    eight = IntMatrix(
        torch.tensor([[7, 200]], dtype=torch.uint8), torch.tensor([[0.25]]), torch.tensor([[8]]).byte(), 8, 2
    )
    assert eight.dequantized(torch.float32).tolist() == [[-0.25, 48.0]]


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group", "rows"), [(4, 32, 1), (4, 32, 70), (4, 96, 5), (8, 16, 5), (8, 96, 33)])
def test_the_kernel_gives_the_product_of_the_dequantized_matrix(
    dtype: torch.dtype, bits: int, group: int, rows: int
) -> None:
    """``x @ W.T + bias`` of ``W`` dequantized into ``x``'s type, the bias added before the one rounding: 4 and 8
    bits, groups of 32, 16, and one a row (96 inputs: GPTQ's group_size -1), a decode's rows and a prefill's; with
    one group's zero point moved, that group's columns change."""
    matrix = _matrix(48, 96, bits, group, seed=rows + bits)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(DEVICE, dtype)
    bias = torch.randn(48, generator=g).to(DEVICE, dtype)
    want = (x.float() @ matrix.dequantized(dtype).float().t() + bias.float()).to(dtype)
    got = int_linear(x, matrix, bias)
    tolerance = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    torch.testing.assert_close(int_linear(x, matrix, bias, kernel=False), want, rtol=0, atol=tolerance)
    matrix.zeros[7, 0] += 1 << (bits - 2)
    moved = int_linear(x, matrix, bias)
    assert not torch.allclose(moved[:, 7], want[:, 7], rtol=0, atol=tolerance)
    torch.testing.assert_close(moved[:, 8:], want[:, 8:], rtol=0, atol=tolerance)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_rows_are_read_by_their_stride_and_none_is_an_empty_product() -> None:
    matrix = _matrix(32, 64, 4, 32, seed=1)
    wide = torch.randn(37, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = int_linear(wide[:, :64], matrix)
    for r in (0, 17, 36):
        torch.testing.assert_close(
            got[r : r + 1], int_linear(wide[r : r + 1, :64].clone(), matrix), rtol=1e-5, atol=1e-5
        )
    assert int_linear(wide[:0, :64], matrix).shape == (0, 32)
