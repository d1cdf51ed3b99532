"""GPTQ's and AWQ's matrices held in their bits (``model/int_stack.py``): the experts' Triton kernel's products of
them (a dense matrix as one expert every row chose, ``held_linear``; a mixture's experts, ``expert_products``)
against the matrices dequantized, in Triton's interpreter on the CPU (fp32 and fp16: the interpreter's bfloat16
products are wrong, so bfloat16 runs on CUDA only). The checkpoints' layouts and the models held so:
``tests/model/test_packed_int.py``."""

from __future__ import annotations

import os

import pytest
import torch

from boundless.model.arch import ModelArch
from boundless.model.fused_moe import held_linear
from boundless.model.int_stack import IntStack
from boundless.model.moe import SparseMoE

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

DEVICE = torch.device(os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu"))
_TRITON_RUNS = triton is not None and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _stack(experts: int, out: int, inputs: int, bits: int, group: int, seed: int) -> IntStack:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, out, inputs * bits // 8), generator=g, dtype=torch.uint8)
    groups = inputs // group
    scales = (torch.rand(experts, out, groups, generator=g) * 0.01 + 0.001).half().float()
    zeros = torch.randint(0, 1 << bits, (experts, out, groups), generator=g, dtype=torch.uint8)
    return IntStack(codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), bits, group)


def test_dequantized_codes_are_the_low_nibble_first() -> None:
    """In 4 bits byte ``i`` holds input ``2i`` in its low nibble, ``2i + 1`` in its high one; each input's group is
    its position's; ``(code - zero) * scale``."""
    codes = torch.tensor([[[0x21, 0x43]]], dtype=torch.uint8)  # (inputs 1, 2, 3, 4)
    stack = IntStack(codes, torch.tensor([[[0.5, 2.0]]]), torch.tensor([[[1, 3]]], dtype=torch.uint8), 4, 2)
    assert stack.shape == (1, 1, 4)
    assert stack.dequantized(0, torch.float32).tolist() == [[0.0, 0.5, 0.0, 2.0]]
    eight = IntStack(
        torch.tensor([[[7, 200]]], dtype=torch.uint8), torch.tensor([[[0.25]]]), torch.tensor([[[8]]]).byte(), 8, 2
    )
    assert eight.dequantized(0, torch.float32).tolist() == [[-0.25, 48.0]]


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group", "rows"), [(4, 32, 1), (4, 32, 70), (4, 96, 5), (8, 16, 5), (8, 96, 33)])
def test_a_dense_matrix_gives_the_product_of_its_dequantized_weights(
    dtype: torch.dtype, bits: int, group: int, rows: int
) -> None:
    """``x @ W.T + bias`` of ``W`` dequantized into ``x``'s type, the bias added before the one rounding: 4 and 8
    bits, groups of 32, 16, and one a row (96 inputs: GPTQ's group_size -1), a decode's rows and a prefill's; with
    one group's zero point moved, that row's column changes and no other."""
    matrix = _stack(1, 48, 96, bits, group, seed=rows + bits)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(DEVICE, dtype)
    bias = torch.randn(48, generator=g).to(DEVICE, dtype)
    want = (x.float() @ matrix.dequantized(0, dtype).float().t() + bias.float()).to(dtype)
    got = held_linear(x, matrix, bias)
    tolerance = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    torch.testing.assert_close(held_linear(x, matrix, bias, kernel=False), want, rtol=0, atol=tolerance)
    matrix.zeros[0, 7, 0] += 1 << (bits - 2)
    moved = held_linear(x, matrix, bias)
    assert not torch.allclose(moved[:, 7], want[:, 7], rtol=0, atol=tolerance)
    torch.testing.assert_close(moved[:, 8:], want[:, 8:], rtol=0, atol=tolerance)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_rows_are_read_by_their_stride_and_none_is_an_empty_product() -> None:
    matrix = _stack(1, 32, 64, 4, 32, seed=1)
    wide = torch.randn(37, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = held_linear(wide[:, :64], matrix)
    for r in (0, 17, 36):
        alone = held_linear(wide[r : r + 1, :64].clone(), matrix)
        torch.testing.assert_close(got[r : r + 1], alone, rtol=1e-5, atol=1e-5)
    assert held_linear(wide[:0, :64], matrix).shape == (0, 32)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group", "tokens"), [(4, 16, 1), (4, 16, 40), (8, -1, 40)])
def test_a_mixtures_experts_held_in_their_bits_give_the_per_expert_sums(
    dtype: torch.dtype, bits: int, group: int, tokens: int
) -> None:
    """A GPTQ mixture's experts (``SparseMoE.hold_int``): the two launches over every expert's codes give what the
    per-expert path gives with each chosen expert dequantized; with the zero points moved they do not."""
    arch = ModelArch(
        model_type="qwen3_moe", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, sparse_layers=(0,),
    )  # fmt: skip
    with torch.device("meta"):
        moe = SparseMoE(arch).to(dtype)
    moe.hold_int(bits, group)  # (after the cast, as the loader holds them: codes, scales and zero points keep types)
    moe = moe.to_empty(device=DEVICE)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        moe.router.copy_(torch.randn(moe.router.shape, generator=g))
        for name in ("gate_up", "down"):
            codes = getattr(moe, name)
            codes.copy_(torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8))
            scale = getattr(moe, f"{name}_scale")  # (small enough that fp16's sums of 8-bit codes stay finite)
            scale.copy_(torch.rand(scale.shape, generator=g) * (0.05 if bits == 4 else 0.003))
            zero = getattr(moe, f"{name}_zero")
            zero.copy_(torch.randint(0, 1 << bits, zero.shape, generator=g, dtype=torch.uint8))
    assert moe.gate_up.dtype == torch.uint8 and moe.gate_up_scale.dtype == torch.float32
    x = torch.randn(tokens, 48, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        want = moe(x)
        tolerance = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        torch.testing.assert_close(moe.forward_fused(x), want, rtol=0, atol=tolerance)
        moe.down_zero.add_(1 << (bits - 2))
        assert not torch.allclose(moe.forward_fused(x), want, rtol=0, atol=tolerance)
