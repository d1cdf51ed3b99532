"""Fused elementwise kernels for the GPU path of the decoder layer (Triton).

On the PyTorch path an RMSNorm is seven kernels, a rotary embedding six and SiLU(gate) * up two; a
decode step of a 16-layer model then launches hundreds of kernels that each move a few kilobytes.
These do each in one launch, with the rounding steps of the Hugging Face reference (each product
rounded to the model's dtype where the reference rounds it), so the GPU path computes what the
PyTorch path computes. They run on CUDA and, for the tests, in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, delta_ptr, weight_ptr, eps, stride_out, stride_x, stride_delta, n_cols,
    ADD: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: with ADD, x += delta first (rounded to x's dtype, as the reference's residual add), then
    out = weight * (x / rms(x)), with ROUND the normalized value rounded to x's dtype before the weight (Llama's; else
    Gemma's, rounded once after it)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = xf * tl.rsqrt(var + eps)
    if ROUND:
        normed = normed.to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_table, num_heads,
    HALF: tl.constexpr, HEADS_POW2: tl.constexpr, HALF_POW2: tl.constexpr,
):  # fmt: skip
    """One token, all its rotated heads, in place (rotate-half layout): first half x1*cos - x2*sin,
    second half x2*cos + x1*sin, each product rounded to the dtype as the reference rounds it."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_POW2)
    i = tl.arange(0, HALF_POW2)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    c = tl.load(cos_ptr + pos * stride_table + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_table + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)).to(dt)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)


@triton.jit
def _silu_mul_kernel(out_ptr, gate_up_ptr, stride_out, stride_in, n_cols, BLOCK: tl.constexpr):
    """One row of [gate | up]: SiLU(gate) rounded to the dtype, times up."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dt), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None, round_normed: bool = True
) -> torch.Tensor:
    """``weight * x / rms(x)`` of rows [tokens, hidden]; with ``delta``, ``x += delta`` first, in place.
    ``round_normed``: the normalized row rounded to ``x``'s dtype before the weight (Llama's; else Gemma's)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows:
        d = delta if delta is not None else x
        _rms_norm_kernel[(rows,)](
            out, x, d, weight, eps, out.stride(0), x.stride(0), d.stride(0), cols,
            ADD=delta is not None, ROUND=round_normed, BLOCK=_pow2(cols), num_warps=4 if cols <= 4096 else 8,
        )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim] (a strided view is fine) in place at ``positions``; ``cos`` and
    ``sin`` are the tables [max_positions, head_dim / 2]."""
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    if tokens:
        _rotary_kernel[(tokens,)](
            x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads,
            HALF=dim // 2, HEADS_POW2=_pow2(heads), HALF_POW2=_pow2(dim // 2),
        )  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows [tokens, 2 * inter] laid out [gate | up]."""
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(cols))
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            out, gate_up, out.stride(0), gate_up.stride(0), cols, BLOCK=block
        )
    return out
