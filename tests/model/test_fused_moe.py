"""The GPU path's mixture of experts (``model/fused_moe.py``): the grouping made on the device, and the two launches
against the per-expert path (``SparseMoE.forward``), in Triton's interpreter on the CPU (fp32 and fp16: the
interpreter's bfloat16 products are wrong, so bfloat16 runs on CUDA only)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from boundless.model import fused_moe
from boundless.model.arch import ModelArch
from boundless.model.moe import SparseMoE
from boundless.model.mxfp4 import Mxfp4Stack, dequantize_mxfp4

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

DEVICE = torch.device(os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu"))
_TRITON_RUNS = triton is not None and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# Against the per-expert path: fp32 up to the sums' order; 16-bit types up to a rounding of the summed outputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _routing(tokens: int, top_k: int, num_experts: int, seed: int, skip: int = 0) -> torch.Tensor:
    """Each token's ``top_k`` distinct experts, at random, none of the last ``skip`` experts (left empty)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts - skip, generator=g)
    return torch.topk(scores, top_k, dim=-1).indices


@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m", "skip"),
    [(1, 2, 8, 16, 0), (3, 4, 16, 16, 5), (40, 2, 8, 16, 0), (200, 4, 8, 64, 3), (7, 1, 4, 4, 1)],
)
def test_grouping_places_every_slot_once_under_its_expert(
    tokens: int, top_k: int, num_experts: int, block_m: int, skip: int
) -> None:
    experts = _routing(tokens, top_k, num_experts, seed=tokens, skip=skip)
    groups = fused_moe.group_by_expert(experts, num_experts, block_m)
    n = tokens * top_k
    slots = groups.sorted_slots.tolist()
    rows = int(groups.num_rows.item())
    assert len(slots) == fused_moe.capacity(n, num_experts, block_m) >= rows and len(slots) % block_m == 0
    assert sorted(s for s in slots if s < n) == list(range(n))  # each slot once
    assert all(s == n for s in slots[rows:])  # (past the rows in use: padding only)
    flat = experts.flatten().tolist()
    counts = [flat.count(e) for e in range(num_experts)]
    assert rows == sum(-(-c // block_m) * block_m for c in counts)
    for b, expert in enumerate(groups.block_experts.tolist()):
        block = slots[b * block_m : (b + 1) * block_m]
        if b * block_m >= rows:
            assert expert == -1
            continue
        real = [s for s in block if s < n]
        assert real and all(flat[s] == expert for s in real)  # (no block of padding alone, none of two experts)
        assert real == sorted(real) and block[: len(real)] == real  # slots in order, the padding after them


def test_grouping_has_no_shape_that_depends_on_the_routing() -> None:
    """The grouping traces whole (no graph break: no read of a value back to the host, no shape that depends on the
    routing), which is what lets a CUDA graph hold a decode step of a mixture."""
    compiled = torch.compile(fused_moe.group_by_expert, fullgraph=True, backend="eager", dynamic=False)
    experts = _routing(5, 2, 8, seed=0)
    got, want = compiled(experts, 8, 16), fused_moe.group_by_expert(experts, 8, 16)
    assert torch.equal(got.sorted_slots, want.sorted_slots)
    assert torch.equal(got.block_experts, want.block_experts)
    # (bincount, which the per-expert path reads, would break the graph: the check can fail.)
    with pytest.raises((torch._dynamo.exc.Unsupported, RuntimeError)):
        torch.compile(lambda e: torch.bincount(e.flatten()).tolist(), fullgraph=True, backend="eager")(experts)


def _moe(kind: str, dtype: torch.dtype, seed: int, norm_topk_prob: bool = True) -> SparseMoE:
    arch = ModelArch(
        model_type=kind, vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
        norm_topk_prob=norm_topk_prob, sparse_layers=(0,),
    )  # fmt: skip
    if kind == "gpt_oss":  # biased router and experts, the clamped SwiGLU (a limit the products reach)
        arch = dataclasses.replace(arch, swiglu_limit=0.5, swiglu_alpha=1.702, num_experts=6)
    moe = SparseMoE(arch)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe.to(DEVICE, dtype)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [0, 1, 5, 70])  # (none; a decode; few tokens an expert: rows in 16s; in 64s)
def test_the_two_launches_give_the_per_expert_sums(kind: str, dtype: torch.dtype, tokens: int) -> None:
    moe = _moe(kind, dtype, seed=tokens)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens + 1)).to(DEVICE, dtype)
    with torch.no_grad():
        want = moe(x)
        got = moe.forward_fused(x)
    assert got.shape == want.shape and got.dtype == dtype
    if tokens:
        assert want.abs().max() > 0.5  # (the experts' outputs count)
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    if kind == "gpt_oss" and tokens == 70:  # the clamp acts: with it lifted the sums differ
        moe.swiglu_limit = 1e4
        with torch.no_grad():
            assert not torch.allclose(moe.forward_fused(x), want, atol=1e-2)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_a_row_gets_the_same_sum_alone_or_in_a_batch() -> None:
    """A row's experts' sum is its own whatever rows share the step (the grid and the blocks change with the batch;
    the products' order of summation may, by a rounding)."""
    moe = _moe("qwen3_moe", torch.float32, seed=3)
    x = torch.randn(33, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        batch = moe.forward_fused(x)
        for row in (0, 17, 32):
            torch.testing.assert_close(moe.forward_fused(x[row : row + 1]), batch[row : row + 1], rtol=0, atol=1e-5)


def _mxfp4_stack(experts: int, rows: int, cols: int, g: torch.Generator) -> Mxfp4Stack:
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 6, 127 + 1, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    return Mxfp4Stack(blocks.to(DEVICE), scales.to(DEVICE))


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 37])
def test_mxfp4_experts_give_the_sums_of_their_dequantized_weights(dtype: torch.dtype, tokens: int) -> None:
    """Experts held as MXFP4 blocks and scales (every one of the 16 codes, scales 2**-6 to 2**1), dequantized tile by
    tile in the kernel: the sums of the same experts dequantized first (transformers' dequantization), which differ
    with the low and high nibbles swapped."""
    g = torch.Generator().manual_seed(tokens)
    num_experts, hidden, inter, top_k = 4, 96, 64, 2
    gate_up, down = _mxfp4_stack(num_experts, 2 * inter, hidden, g), _mxfp4_stack(num_experts, hidden, inter, g)

    def dense(stack: Mxfp4Stack) -> torch.Tensor:
        return dequantize_mxfp4(stack.blocks, stack.scales, torch.float32).to(dtype)

    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    experts = _routing(tokens, top_k, num_experts, seed=tokens).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(DEVICE, dtype)
    moe = _moe("qwen3_moe", dtype, seed=0)

    def products(up: torch.Tensor | Mxfp4Stack, dn: torch.Tensor | Mxfp4Stack) -> torch.Tensor:
        return fused_moe.expert_products(x, experts, weights, up, dn, moe.activate)

    want = products(dense(gate_up), dense(down))
    tolerance = TOLERANCE[dtype] * want.abs().max().item()
    torch.testing.assert_close(products(gate_up, down), want, rtol=0, atol=tolerance)
    swapped = Mxfp4Stack((gate_up.blocks >> 4) | (gate_up.blocks << 4), gate_up.scales)
    assert not torch.allclose(products(swapped, down), want, rtol=0, atol=tolerance)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "tokens"), [("qwen3_moe", 1), ("qwen3_moe", 40), ("gpt_oss", 40)])
def test_fp8_experts_give_the_sums_of_their_dequantized_weights(kind: str, dtype: torch.dtype, tokens: int) -> None:
    """``--quantization fp8``'s experts (e4m3, a scale per expert's output row, SparseMoE.quantize_fp8): the kernel
    widens each tile and scales its product as it sums; the per-expert path dequantizes the chosen experts. The two
    agree, and without the scales they would not."""
    moe = _moe(kind, dtype, seed=tokens)
    moe.quantize_fp8()
    assert moe.held == "fp8" and moe.gate_up.dtype == torch.float8_e4m3fn
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens + 1)).to(DEVICE, dtype)
    with torch.no_grad():
        want = moe(x)
        tolerance = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        torch.testing.assert_close(moe.forward_fused(x), want, rtol=0, atol=tolerance)
        moe.gate_up_scale.mul_(2)
        assert not torch.allclose(moe.forward_fused(x), want, rtol=0, atol=tolerance)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_mxfp4_scales_of_the_smallest_exponents_are_exact() -> None:
    """Exponent bytes 0 to 2: the kernel's scale made from its bits is 2 ** (e - 127) for each (0: fp32's subnormal
    2 ** -127), as the dequantization's ``ldexp`` gives it."""
    g = torch.Generator().manual_seed(5)
    stack = _mxfp4_stack(1, 32, 64, g)
    stack = Mxfp4Stack(stack.blocks, torch.randint(0, 3, stack.scales.shape, generator=g, dtype=torch.uint8).to(DEVICE))
    dense = dequantize_mxfp4(stack.blocks, stack.scales, torch.float32)
    x = torch.randn(3, 64, generator=g).to(DEVICE)
    groups = fused_moe.group_by_expert(torch.zeros(3, 1, dtype=torch.long, device=DEVICE), 1, 16)
    got, want = (torch.empty(3, 32, device=DEVICE) for _ in range(2))
    fused_moe._product(got, x, stack, None, groups, 1, None, 32, 32)
    fused_moe._product(want, x, dense, None, groups, 1, None, 32, 32)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_biases_of_any_layout_are_read_as_their_values() -> None:
    """Biases given as strided views (a transposed tensor's) are read by value, not by a stride of 1 (the fuzzer's
    find: they were read past their rows)."""
    moe = _moe("gpt_oss", torch.float32, seed=9)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    assert moe.gate_up_bias is not None and moe.down_bias is not None
    experts, weights = moe.route(x)
    stacks = moe.stack("gate_up"), moe.stack("down")
    with torch.no_grad():
        want = fused_moe.expert_products(x, experts, weights, *stacks, moe.activate, moe.gate_up_bias, moe.down_bias)
        strided = [b.t().contiguous().t() for b in (moe.gate_up_bias, moe.down_bias)]
        assert strided[0].stride(1) != 1
        torch.testing.assert_close(
            fused_moe.expert_products(x, experts, weights, *stacks, moe.activate, *strided), want
        )


def _block_fp8(out: int, inputs: int, block: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 matrix [out, inputs] and its scales, one a block (an FP8 checkpoint's, Qwen3's form)."""
    weight = (torch.randn(out, inputs, generator=g) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(out // block[0], inputs // block[1], generator=g) * 0.02 + 0.001
    return weight.to(DEVICE), scales.to(DEVICE)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 5, 70])
def test_a_dense_fp8_matrix_in_blocks_gives_the_product_of_its_dequantized_weights(
    dtype: torch.dtype, rows: int
) -> None:
    """An FP8 checkpoint's dense matrix held as stored (``held_linear``: the experts' kernel over one expert that
    every row chose) gives ``x @ W.T + bias`` of ``W`` dequantized (its scale a block of 16 rows by 32 inputs), the
    bias added before the one rounding; with any scale of one block changed it does not."""
    g = torch.Generator().manual_seed(rows)
    block = (16, 32)
    weight, scales = _block_fp8(48, 128, block, g)
    bias = torch.randn(48, generator=g).to(DEVICE, dtype)
    x = torch.randn(rows, 128, generator=g).to(DEVICE, dtype)
    dense = fused_moe.Fp8Stack(weight[None], scales[None], block).dequantized(0, torch.float32)
    want = (x.float() @ dense.t() + bias.float()).to(dtype)
    got = fused_moe.held_linear(x, fused_moe.Fp8Stack(weight[None], scales[None], block), bias)
    assert got.shape == (rows, 48) and got.dtype == dtype
    if rows == 0:
        return
    tolerance = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    dequantized = fused_moe.held_linear(x, fused_moe.Fp8Stack(weight[None], scales[None], block), bias, kernel=False)
    torch.testing.assert_close(dequantized, want, rtol=0, atol=tolerance)
    scales[1, 2] *= 2  # (rows 16-31, inputs 64-95)
    changed = fused_moe.held_linear(x, fused_moe.Fp8Stack(weight[None], scales[None], block), bias)
    assert not torch.allclose(changed[:, 16:32], want[:, 16:32], rtol=0, atol=tolerance)
    torch.testing.assert_close(changed[:, :16], want[:, :16], rtol=0, atol=tolerance)


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
def test_one_experts_groups_are_made_once_for_each_size() -> None:
    """Every held matrix of a step takes the same groups (a dense product is one expert every row chose): made once
    for each number of rows and block, not three launches a product."""
    groups = fused_moe.one_expert(37, 16, DEVICE)
    assert fused_moe.one_expert(37, 16, DEVICE) is groups
    assert fused_moe.one_expert(36, 16, DEVICE) is not groups and fused_moe.one_expert(37, 64, DEVICE) is not groups
    assert groups.sorted_slots.tolist() == list(range(37)) + [37] * 11  # (the last block's padding: no slot)
    assert groups.block_experts.tolist() == [0, 0, 0] and groups.num_rows.tolist() == [48]


def test_a_dense_fp8_product_reads_its_input_rows_by_their_stride() -> None:
    """A view's rows (q/k/v's slice of a wider tensor, a stride past their width) and rows past a multiple of the
    kernel's row block: each row's product is its own, whatever rows share the call."""
    g = torch.Generator().manual_seed(3)
    weight, scales = _block_fp8(32, 64, (16, 16), g)
    wide = torch.randn(37, 96, generator=g).to(DEVICE)
    x = wide[:, :64]
    matrix = fused_moe.Fp8Stack(weight[None], scales[None], (16, 16))
    got = fused_moe.held_linear(x, matrix)
    for r in (0, 17, 36):
        alone = fused_moe.held_linear(x[r : r + 1].clone(), matrix)
        torch.testing.assert_close(got[r : r + 1], alone, rtol=1e-5, atol=1e-5)
