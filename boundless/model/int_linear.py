"""A GPTQ or AWQ checkpoint's matrices held in their 4 or 8 bits a weight, and their products (vLLM's W4A16: the
weights read as stored, the activations in the model's type).

``model/packed_int.py`` reads each packed layer; held as stored (on a GPU with Triton, one rank: the loader's
``quantized_dense``), a matrix ``[out, in]`` becomes :class:`IntMatrix`'s three tensors, its rows in the model's
order so that q's, k's and v's (gate's and up's) stack as their rows do:

- ``codes``: uint8 ``[out, in * bits / 8]``; in 4 bits input ``2i`` the low nibble of byte ``i``, ``2i + 1`` its high
  one (GPTQ's own order: its int32s, transposed, are these bytes); in 8 bits a byte an input;
- ``scales``: ``[out, groups]`` as stored (fp16); ``zeros``: uint8 ``[out, groups]``, each group's zero point;

and ``weight[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g]`` for input ``i`` of group ``g = i // group``, in fp32
(what ``PackedIntCheckpoint.weight`` computes), then the activations' type. A 4-bit 72B model then takes ~40 GB,
where held in bfloat16 it took ~145.

:func:`int_linear` takes each product in one launch of :func:`_int_product_kernel` (CUDA; the CPU under Triton's
interpreter in the tests): a program reads a tile of codes, dequantizes it in registers (exactly as above: the
values in fp32, rounded once to the activations' type), and in 4 bits multiplies the even inputs by the low nibbles
and the odd ones by the high ones apart, as the MXFP4 experts' kernel does. Elsewhere a matrix is dequantized: once,
packed for the native CPU kernel (``DecoderLayer.widen_fp8``), or for each product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with PyTorch's CUDA builds and the test extra
    triton = None


@dataclass(frozen=True)
class IntMatrix:
    """A matrix held in ``bits`` (4 or 8) a weight with a scale and a zero point a ``group`` of inputs (the module
    docstring's layout)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group: int

    @property
    def inputs(self) -> int:
        return self.codes.shape[1] * 8 // self.bits

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix ``[out, in]`` in ``dtype``: ``(code - zero) * scale`` in fp32, rounded once."""
        codes = self.codes
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
        groups = torch.arange(self.inputs, device=codes.device) // self.group
        values = (codes.to(torch.int32) - self.zeros[:, groups].to(torch.int32)).to(torch.float32)
        return (values * self.scales[:, groups].to(torch.float32)).to(dtype)


if triton is not None:

    @triton.jit
    def _int_product_kernel(
        out_ptr, a_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, m_rows, n_cols, k_cols,
        stride_am, stride_qn, stride_sn, stride_om,
        GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[pid_m * BLOCK_M, +BLOCK_M)`` of ``a`` [m_rows, k_cols] times columns ``[pid_n * BLOCK_N, +BLOCK_N)``
        of the matrix held as codes ``q`` [n_cols, k_cols * BITS / 8], scales ``s`` and zero points ``z`` [n_cols,
        k_cols / GROUP] (:class:`IntMatrix`), plus the bias, rounded once into ``out``'s type. A tile's codes are
        dequantized in fp32 and rounded to ``a``'s type (as :meth:`IntMatrix.dequantized`); the sums are fp32."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < m_rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        a_base = a_ptr + rows[:, None].to(tl.int64) * stride_am
        q_base = q_ptr + cols[None, :].to(tl.int64) * stride_qn
        s_base = s_ptr + cols[None, :] * stride_sn
        z_base = z_ptr + cols[None, :] * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_cols, BLOCK_K):
            if BITS == 4:
                byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b_ok = byte < k_cols // 2
                w_mask = b_ok[:, None] & col_ok[None, :]
                packed = tl.load(q_base + byte[:, None], mask=w_mask, other=0).to(tl.int32)
                group = (2 * byte[:, None]) // GROUP  # (a group's size is even: a byte's two inputs share it)
                scale = tl.load(s_base + group, mask=w_mask, other=0.0).to(tl.float32)
                zero = tl.load(z_base + group, mask=w_mask, other=0).to(tl.int32)
                a_mask = row_ok[:, None] & b_ok[None, :]
                even = tl.load(a_base + 2 * byte[None, :], mask=a_mask, other=0.0)
                odd = tl.load(a_base + 2 * byte[None, :] + 1, mask=a_mask, other=0.0)
                low = (((packed & 15) - zero).to(tl.float32) * scale).to(even.dtype)
                high = (((packed >> 4) - zero).to(tl.float32) * scale).to(even.dtype)
                acc += tl.dot(even, low, input_precision=PRECISION)
                acc += tl.dot(odd, high, input_precision=PRECISION)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_cols
                w_mask = k_ok[:, None] & col_ok[None, :]
                code = tl.load(q_base + ks[:, None], mask=w_mask, other=0).to(tl.int32)
                group = ks[:, None] // GROUP
                scale = tl.load(s_base + group, mask=w_mask, other=0.0).to(tl.float32)
                zero = tl.load(z_base + group, mask=w_mask, other=0).to(tl.int32)
                a = tl.load(a_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = ((code - zero).to(tl.float32) * scale).to(a.dtype)
                acc += tl.dot(a, w, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def int_linear(
    x: torch.Tensor, matrix: IntMatrix, bias: torch.Tensor | None = None, kernel: bool = True
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` the matrix held in ``matrix``: ``kernel``, one launch of
    :func:`_int_product_kernel`; else (the PyTorch path, or a device without Triton) ``W`` dequantized into ``x``'s
    type for the product."""
    shape = x.shape
    n = matrix.codes.shape[0]
    rows = x.reshape(-1, shape[-1])
    if not kernel or triton is None:
        return F.linear(rows, matrix.dequantized(x.dtype), bias).view(*shape[:-1], n)
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*shape[:-1], n)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    assert (
        matrix.codes.stride(-1) == 1
        and matrix.scales.stride(-1) == 1
        and matrix.zeros.stride() == matrix.scales.stride()
    )
    # (A decode's few rows in blocks of 16; untuned, as fused_moe.block_sizes.)
    block_m = 16 if rows.shape[0] <= 32 else 64
    block_n, block_k = 64, 32 if x.dtype == torch.float32 else 64
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, block_n))
    _int_product_kernel[grid](
        out, rows, matrix.codes, matrix.scales, matrix.zeros, out if bias is None else bias.contiguous(),
        rows.shape[0], n, matrix.inputs, rows.stride(0), matrix.codes.stride(0), matrix.scales.stride(0),
        out.stride(0),
        GROUP=matrix.group, BITS=matrix.bits, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out.view(*shape[:-1], n)
