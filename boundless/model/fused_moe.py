"""A mixture of experts' products in two Triton launches, with no read back to the host (vLLM's fused MoE design).

:meth:`SparseMoE.forward` groups a step's tokens by expert on the host (it reads how many tokens each expert got) and
runs two matmuls an expert: on a GPU that is a host synchronization and a few dozen launches a layer, and no CUDA
graph can hold it. Here the grouping is made on the device, in tensors whose shapes depend only on the batch's size
(:func:`group_by_expert`), and each product is one launch over all experts (:func:`expert_products`): a program takes
``block_m`` rows that all chose one expert, reads that expert's weights and writes its rows' outputs in place. Rows
are padded per expert to a multiple of ``block_m``; programs past the rows in use return at once, so the grid, too, is
fixed by the batch's size, and a decode step with experts can be captured in a graph.

Rounding follows transformers' experts: each product rounded to the model's type (with its bias, as ``nn.Linear``),
the activation between them, the down product rounded before the routing weight scales it. The ``top_k`` outputs of a
token are then summed (in fp32, rounded once, where transformers adds them one at a time into the model's type: the
same to a rounding in bfloat16, to the summation's order in fp32).

gpt-oss's experts may come as their checkpoint's MXFP4 blocks and scales (``Mxfp4Stack``): the kernel then reads a
quarter of bfloat16's bytes and dequantizes each tile in registers (vLLM reads them with its own MXFP4 kernels); and
under ``--quantization fp8`` as e4m3 with a scale per output row (``Fp8Stack``): half the bytes, each tile widened to
the input's type and its product scaled.

GPTQ's and AWQ's experts may come in their 4 or 8 bits (``IntStack``): codes, a scale and a zero point a group of
inputs, each tile dequantized in registers.

A dense matrix is a mixture of one expert that every row chose (:func:`held_linear`): an FP8 checkpoint's attention
and MLP matrices, held in e4m3 with a scale a block (Qwen3's 128 x 128), and a GPTQ or AWQ checkpoint's in their
bits, run through the same kernel.

The kernels run on CUDA and, for the tests, in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``); the CPU's
own path stays the per-expert one (its native kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from boundless.model.fp8_linear import Fp8Stack
from boundless.model.int_stack import IntStack
from boundless.model.mxfp4 import Mxfp4Stack

HeldStack = Mxfp4Stack | Fp8Stack | IntStack  # (a stack of matrices held quantized)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with PyTorch's CUDA builds and the test extra
    triton = None


@dataclass(frozen=True)
class ExpertGroups:
    """A step's routed rows (``slot = token * top_k + j``: the token's ``j``-th expert) grouped by expert, each
    expert's group padded to a multiple of ``block_m`` rows, all on the device.

    ``sorted_slots[r]``: the slot of row ``r`` (``num_slots`` on a padding row); ``block_experts[b]``: the expert of
    rows ``[b * block_m, (b + 1) * block_m)`` (-1 past the rows in use); ``num_rows``: the rows in use, one int32."""

    sorted_slots: torch.Tensor  # int32 [capacity]
    block_experts: torch.Tensor  # int32 [capacity / block_m]
    num_rows: torch.Tensor  # int32 [1]
    block_m: int
    num_slots: int


def capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """The rows that ``num_slots`` routed rows may take once padded, a multiple of ``block_m``: each expert pads at
    most ``block_m - 1``, and with fewer slots than experts at most ``num_slots`` experts are chosen, each padded to at
    most ``block_m`` rows a slot."""
    rows = num_slots + num_experts * (block_m - 1)
    if num_slots < num_experts:
        rows = min(rows, num_slots * block_m)
    return -(-rows // block_m) * block_m


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """The rows of ``experts`` [tokens, top_k] (each token's chosen experts) grouped by expert, in the order of their
    slots within an expert. Only device ops whose shapes the batch's size fixes (no ``bincount``, no ``nonzero``)."""
    flat = experts.flatten().long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    chosen = flat[order]
    # A slot's place: its expert's first padded row, plus its rank among the expert's slots.
    first_slot = torch.cumsum(counts, 0) - counts
    rows = (ends - padded)[chosen] + torch.arange(n, device=device) - first_slot[chosen]
    size = capacity(n, num_experts, block_m)
    sorted_slots = torch.full((size,), n, dtype=torch.int32, device=device)
    sorted_slots[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=device)
    # The expert whose padded rows hold the block's first (empty experts end where they start: never found).
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    total = ends[-1:]
    block_experts = torch.where(block_starts < total, block_experts, -1).to(torch.int32)
    return ExpertGroups(sorted_slots, block_experts, total.to(torch.int32), block_m, n)


# one_expert's groups by (rows, block, device): every held matrix of a step takes the same (three small launches
# each, four matrices a layer, else). Bounded: a step's rows may be any number up to its token budget, each size a
# few KB of int32s.
_ONE_EXPERT: dict[tuple[int, int, torch.device], ExpertGroups] = {}
_ONE_EXPERT_SIZES = 1024


def one_expert(num_rows: int, block_m: int, device: torch.device) -> ExpertGroups:
    """``num_rows`` rows that all chose expert 0, in order (a dense matrix's product through the experts' kernel):
    row ``r`` is slot ``r``, the last block padded. Made once for each size (the kernel only reads them), except
    while a CUDA graph is captured: tensors made then hold their values only as the graph replays."""
    key = (num_rows, block_m, device)
    if device.type == "cuda":
        with torch.cuda.device(device):  # (the capture is of that device's current stream)
            capturing = torch.cuda.is_current_stream_capturing()
    else:
        capturing = False
    if not capturing and (groups := _ONE_EXPERT.get(key)) is not None:
        return groups
    size = -(-num_rows // block_m) * block_m
    sorted_slots = torch.arange(size, dtype=torch.int32, device=device).clamp_(max=num_rows)
    block_experts = torch.zeros(size // block_m, dtype=torch.int32, device=device)
    total = torch.full((1,), size, dtype=torch.int32, device=device)
    groups = ExpertGroups(sorted_slots, block_experts, total, block_m, num_rows)
    if not capturing:
        if len(_ONE_EXPERT) >= _ONE_EXPERT_SIZES:
            _ONE_EXPERT.clear()
        _ONE_EXPERT[key] = groups
    return groups


if triton is not None:

    @triton.jit
    def _e2m1(nibble):
        """FP4 (e2m1) values of 4-bit codes: sign, two exponent bits, one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
        code = nibble.to(tl.int32)
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        normal = (1.0 + 0.5 * mantissa) * (1 << exponent).to(tl.float32) * 0.5
        magnitude = tl.where(exponent == 0, 0.5 * mantissa, normal)
        return tl.where((code & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def _expert_product_kernel(
        out_ptr, a_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, routing_ptr, sorted_ptr, block_expert_ptr,
        num_rows_ptr, n_cols, k_cols, num_slots, a_row_of_slot,
        stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_om,
        HAS_BIAS: tl.constexpr, ROUTED: tl.constexpr, MXFP4: tl.constexpr, FP8: tl.constexpr,
        SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, INT_BITS: tl.constexpr, GROUP: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[pid_m * BLOCK_M, +BLOCK_M)`` of the grouped rows (one expert's) times columns
        ``[pid_n * BLOCK_N, +BLOCK_N)`` of that expert's weight [n_cols, k_cols]; a row reads the input row
        ``slot // a_row_of_slot`` and writes the output row ``slot``. With ROUTED the product, rounded to the output's
        type, is scaled by the slot's routing weight.

        With MXFP4 the weight is its blocks (bytes [n_cols, k_cols / 2]: input ``2i`` the low nibble of byte ``i``,
        ``2i + 1`` its high one) and scales ([n_cols, k_cols / 32], an exponent biased by 127): a tile's bytes are
        dequantized in registers (exactly: the scale is made from its bits) and the even and odd inputs multiplied
        apart, so the values are never interleaved. BLOCK_K is then a multiple of 32.

        With FP8 the weight is e4m3 with a scale [n_cols / SCALE_N, k_cols / SCALE_K] a block (SCALE_K 0: one along
        the whole row): each tile's product is taken in the input's type (e4m3 widens exactly) and scaled as it is
        summed, a column's scale factoring out of its sum. SCALE_K is then a multiple of BLOCK_K.

        With INT_BITS (4 or 8; 0: none) the weight is codes (bytes [n_cols, k_cols * INT_BITS / 8]: in 4 bits input
        ``2i`` the low nibble of byte ``i``), with scales (fp32) and zero points (uint8) [n_cols, k_cols / GROUP] a
        group of inputs, read along the scales' strides: each tile's ``(code - zero) * scale`` in fp32, rounded to the
        input's type, and in 4 bits the even and odd inputs multiplied apart, as MXFP4's."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_ptr + rows).to(tl.int64)
        valid = slots < num_slots
        a_rows = slots // a_row_of_slot
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        a_base = a_ptr + a_rows[:, None] * stride_am
        w_base = w_ptr + expert * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MXFP4:
            s_base = scale_ptr + expert * stride_se + cols[None, :] * stride_sn
            for k0 in range(0, k_cols, BLOCK_K):
                byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b_ok = byte < k_cols // 2
                w_mask = b_ok[:, None] & col_ok[None, :]
                packed = tl.load(w_base + byte[:, None] * stride_wk, mask=w_mask, other=0)
                exponent = tl.load(s_base + (byte[:, None] // 16) * stride_sk, mask=w_mask, other=127)
                # 2 ** (exponent - 127) from its bits (exponent 0: 2 ** -127, fp32's subnormal 0x400000).
                bits = tl.where(exponent == 0, 0x400000, exponent.to(tl.int32) << 23)
                scale = bits.to(tl.float32, bitcast=True)
                a_mask = valid[:, None] & b_ok[None, :]
                even = tl.load(a_base + 2 * byte[None, :], mask=a_mask, other=0.0)
                odd = tl.load(a_base + 2 * byte[None, :] + 1, mask=a_mask, other=0.0)
                low = (_e2m1(packed & 15) * scale).to(even.dtype)
                high = (_e2m1(packed >> 4) * scale).to(even.dtype)
                acc += tl.dot(even, low, input_precision=PRECISION)
                acc += tl.dot(odd, high, input_precision=PRECISION)
        elif INT_BITS == 4:
            s_base = scale_ptr + expert * stride_se + cols[None, :] * stride_sn
            z_base = zero_ptr + expert * stride_se + cols[None, :] * stride_sn
            for k0 in range(0, k_cols, BLOCK_K):
                byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b_ok = byte < k_cols // 2
                w_mask = b_ok[:, None] & col_ok[None, :]
                packed = tl.load(w_base + byte[:, None] * stride_wk, mask=w_mask, other=0).to(tl.int32)
                group = ((2 * byte[:, None]) // GROUP) * stride_sk  # (a group is even: a byte's two inputs share it)
                scale = tl.load(s_base + group, mask=w_mask, other=0.0)
                zero = tl.load(z_base + group, mask=w_mask, other=0).to(tl.int32)
                a_mask = valid[:, None] & b_ok[None, :]
                even = tl.load(a_base + 2 * byte[None, :], mask=a_mask, other=0.0)
                odd = tl.load(a_base + 2 * byte[None, :] + 1, mask=a_mask, other=0.0)
                low = (((packed & 15) - zero).to(tl.float32) * scale).to(even.dtype)
                high = (((packed >> 4) - zero).to(tl.float32) * scale).to(even.dtype)
                acc += tl.dot(even, low, input_precision=PRECISION)
                acc += tl.dot(odd, high, input_precision=PRECISION)
        elif INT_BITS == 8:
            s_base = scale_ptr + expert * stride_se + cols[None, :] * stride_sn
            z_base = zero_ptr + expert * stride_se + cols[None, :] * stride_sn
            for k0 in range(0, k_cols, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_cols
                w_mask = k_ok[:, None] & col_ok[None, :]
                code = tl.load(w_base + ks[:, None] * stride_wk, mask=w_mask, other=0).to(tl.int32)
                group = (ks[:, None] // GROUP) * stride_sk
                scale = tl.load(s_base + group, mask=w_mask, other=0.0)
                zero = tl.load(z_base + group, mask=w_mask, other=0).to(tl.int32)
                a = tl.load(a_base + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                acc += tl.dot(a, ((code - zero).to(tl.float32) * scale).to(a.dtype), input_precision=PRECISION)
        elif FP8:
            s_base = scale_ptr + expert * stride_se + (cols // SCALE_N) * stride_sn
            scale = tl.load(s_base, mask=col_ok, other=0.0)
            for k0 in range(0, k_cols, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_cols
                a = tl.load(a_base + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if SCALE_K > 0:
                    scale = tl.load(s_base + (k0 // SCALE_K) * stride_sk, mask=col_ok, other=0.0)
                acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]
        else:
            for k0 in range(0, k_cols, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_cols
                a = tl.load(a_base + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc += tl.dot(a, w, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dt = out_ptr.dtype.element_ty
        if ROUTED:
            weight = tl.load(routing_ptr + slots, mask=valid, other=0.0).to(tl.float32)
            acc = acc.to(dt).to(tl.float32) * weight[:, None]
        out_mask = valid[:, None] & col_ok[None, :]
        tl.store(out_ptr + slots[:, None] * stride_om + cols[None, :], acc.to(dt), mask=out_mask)


def block_sizes(num_tokens: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) for a step of ``num_tokens``, after vLLM's default configuration (its row and
    column blocks; untuned here): with few tokens an expert, rows in 16s (most of a block would be padding
    otherwise); fp32 tiles half as deep."""
    block_k = 32 if dtype == torch.float32 else 64
    if num_tokens <= num_experts:
        return 16, 32, block_k
    return 64, 64, block_k


def _product(
    out: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor | HeldStack,
    bias: torch.Tensor | None,
    groups: ExpertGroups,
    a_row_of_slot: int,
    routing: torch.Tensor | None,
    block_n: int,
    block_k: int,
) -> None:
    """``out[slot] = a[slot // a_row_of_slot] @ weight[expert].T (+ bias[expert])`` for every grouped slot, in one
    launch; with ``routing``, the rounded product times the slot's routing weight."""
    # (Rows read and written along a stride of 1: a size-1 dimension's stride may be anything, and is never used.)
    assert (a.stride(-1) == 1 or a.shape[-1] == 1) and (out.stride(-1) == 1 or out.shape[-1] == 1)
    _, n_cols, k_cols = weight.shape
    bias = None if bias is None else bias.contiguous()  # (an expert's bias read along a stride of 1)
    scale_block, zeros, int_bits, group = (1, 0), None, 0, 1
    if isinstance(weight, IntStack):
        w, scales, zeros, int_bits, group = weight.codes, weight.scales, weight.zeros, weight.bits, weight.group
        assert w.stride(-1) == 1 and zeros.stride() == scales.stride() and (int_bits == 8 or group % 2 == 0)
    elif isinstance(weight, Mxfp4Stack):
        w, scales = weight.blocks.flatten(-2), weight.scales  # (bytes [experts, out, in / 2])
        assert w.stride(-1) == 1 and block_k % 32 == 0
    elif isinstance(weight, Fp8Stack):
        w, scales, scale_block = weight.weight, weight.scales, weight.block
        if scale_block[1]:  # (a tile's inputs within one scale's block)
            block_k = min(block_k, scale_block[1])
            assert scale_block[1] % block_k == 0
    else:
        w, scales = weight, weight
    scale_strides = (scales.stride(0), scales.stride(1), scales.stride(2)) if scales is not w else (0, 0, 0)
    grid = (groups.block_experts.numel(), triton.cdiv(n_cols, block_n))
    _expert_product_kernel[grid](
        out, a, w, scales, w if zeros is None else zeros, w if bias is None else bias,
        out if routing is None else routing,
        groups.sorted_slots, groups.block_experts, groups.num_rows,
        n_cols, k_cols, groups.num_slots, a_row_of_slot,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), *scale_strides, 0 if bias is None else bias.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None, ROUTED=routing is not None, MXFP4=isinstance(weight, Mxfp4Stack),
        FP8=isinstance(weight, Fp8Stack), SCALE_N=scale_block[0], SCALE_K=scale_block[1], INT_BITS=int_bits,
        GROUP=group,
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=groups.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def expert_products(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor | HeldStack,
    down: torch.Tensor | HeldStack,
    activate: Callable[[torch.Tensor], torch.Tensor],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each row of ``x`` [tokens, hidden]: ``experts`` [tokens, top_k] chosen with
    ``weights`` (in ``x``'s type, or fp32: GLM-4.5's), ``gate_up`` [experts, 2 * inter, hidden] and ``down``
    [experts, hidden, inter] (each in ``x``'s type, MXFP4, FP8 or in 4 or 8 bits; with their biases [experts, out]
    or None), ``activate`` the gated activation of [rows, 2 * inter] rows."""
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts = gate_up.shape[0]
    if tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = block_sizes(tokens, num_experts, x.dtype)
    groups = group_by_expert(experts, num_experts, block_m)
    x = x.contiguous()
    products = torch.empty(tokens * top_k, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _product(products, x, gate_up, gate_up_bias, groups, top_k, None, block_n, block_k)
    activated = activate(products).contiguous()
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _product(out, activated, down, down_bias, groups, 1, weights.reshape(-1).contiguous(), block_n, block_k)
    return out.view(tokens, top_k, hidden).sum(dim=1)


def held_linear(
    x: torch.Tensor, matrix: Fp8Stack | IntStack, bias: torch.Tensor | None = None, kernel: bool = True
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` a quantized checkpoint's matrix held as stored, a stack of one (an FP8
    checkpoint's e4m3 with a scale a block; a GPTQ or AWQ checkpoint's codes). ``kernel``: one launch of the experts'
    kernel over one expert that every row chose (each tile made in the input's type in registers, the bias added
    before the one rounding, as ``nn.Linear`` rounds); else (the PyTorch path, or a device without Triton) ``W``
    dequantized into ``x``'s type for the product."""
    shape = x.shape
    n = matrix.shape[1]
    rows = x.reshape(-1, shape[-1])
    if not kernel or triton is None:
        return F.linear(rows, matrix.dequantized(0, x.dtype), bias).view(*shape[:-1], n)
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*shape[:-1], n)
    # (A decode's few rows in blocks of 16, most of a block of 64 would be padding; untuned, as block_sizes.)
    block_m, block_n, block_k = (16, 64, 64) if rows.shape[0] <= 32 else (64, 64, 64)
    block_k = block_k // 2 if x.dtype == torch.float32 else block_k
    groups = one_expert(rows.shape[0], block_m, x.device)
    _product(
        out, rows if rows.stride(-1) == 1 else rows.contiguous(), matrix, None if bias is None else bias.unsqueeze(0),
        groups, 1, None, block_n, block_k,
    )  # fmt: skip
    return out.view(*shape[:-1], n)
