"""FP8 matrix products (``--quantization fp8``, vLLM's online FP8): a layer's weights held in e4m3, one scale per
output row, and each product's activations quantized per token as it runs (dynamic scales), multiplied by
``torch._scaled_mm`` into the model's type.

Why: a decode step reads every weight once, so its time is the weights' bytes over the memory's bandwidth; in fp8 a
16-bit model's layers are half the bytes (an 8B model's 15 GB, 7.5 GB). On a GPU with FP8 tensor cores (sm_89 and
later: Ada, Hopper) the product itself is native. Rows of the weight and of the activations each get their own scale
(the finest ``_scaled_mm`` takes), which keeps an outlier row from flattening the rest. The embedding, the LM head,
the norms and a mixture's experts stay in the model's type, as vLLM keeps them.

On CUDA each product's activations are quantized by one Triton kernel (:func:`_quantize_rows_kernel`: a row's
largest magnitude, its scale and the rounded row in one launch), not the eight elementwise kernels of PyTorch's ops: an
8B model's decode step makes 128 products, and a thousand launches of a few microseconds each would take as long as
the halved weights save. The kernel computes what the PyTorch ops compute (the same fp32 division, rounded to
nearest), which is what the CPU runs.

``_scaled_mm``'s rules on CUDA (PyTorch's ``ScaledBlas.cpp``: ``_scaled_mm_out_cuda`` and ``is_rowwise_scaling``):
the first operand row-major and the second column-major (cuBLASLt on sm_90 takes only "TN"), the inner and outer
sides of the weight multiples of 16, scales in fp32 shaped [M, 1] and [1, N] and contiguous. The weight ``[N, K]`` is
held row-major, so its transpose is the column-major second operand. Where cuBLASLt still refuses a shape with
scales per row (``CUBLAS_STATUS_NOT_SUPPORTED`` from its heuristic, reported on H100 for a long inner side and few
rows), the product is taken with unit scales into fp32 and scaled after (:func:`_product_scaled_after`: the same
sums, one more pass over the output), and the shape is remembered so the refusal is met once.

On the CPU PyTorch's fp8 product is a reference implementation, many times slower than an fp32 one: it runs and is
tested there, but it is for GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from boundless.config import QUANTIZATIONS, ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with PyTorch's CUDA builds and the test extra
    triton = None

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# A row's scale is its largest magnitude times this (fp32's 1/448), not over 448: PyTorch's CUDA kernels divide by a
# number as a product with its reciprocal, its CPU kernels divide. One product is the same on both and in Triton.
_INV_FP8_MAX = 1.0 / FP8_MAX
_TINY = 1e-12  # a row of zeros gets this scale, not a division by zero
_QUANTIZE_BLOCK = 1024  # columns a program reads at a time (a row of 14,336 in 14 reads, twice)

# (M, K, N) shapes whose product with scales per row cuBLASLt refused on this process's GPU: taken the other way.
ROWWISE_REFUSED: set[tuple[int, int, int]] = set()


def quantizable(weight: torch.Tensor) -> bool:
    """Whether ``_scaled_mm`` takes this [out, in] weight: both sides multiples of 16 (CUDA's kernels ask it)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as e4m3 and its scales [1, out] in fp32 (``weight[r] ~= q[r] * scale[0, r]``)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return (w / scale).to(FP8), scale.t().contiguous()


@dataclass(frozen=True)
class Fp8Stack:
    """A stack of matrices [experts, out, in] held in e4m3 (a mixture's experts under ``--quantization fp8``), with
    scales [experts, out / block[0], in / block[1]] in fp32: one a block of ``block`` (rows, inputs); an input side of
    0 means the whole row (a scale per output row, as :func:`quantize_rows` makes)."""

    weight: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int] = (1, 0)

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, out, inputs = self.weight.shape
        return experts, out, inputs

    def dequantized(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Matrix ``index`` of the stack [out, in] in ``dtype`` (each value times its block's scale, in fp32)."""
        rows, cols = self.block
        scales = self.scales[index].repeat_interleave(rows, dim=0)[: self.weight.shape[1]]
        if cols:
            scales = scales.repeat_interleave(cols, dim=1)[:, : self.weight.shape[2]]
        return (self.weight[index].float() * scales).to(dtype)


def quantize_stack(weight: torch.Tensor) -> Fp8Stack:
    """``weight`` [experts, out, in] as e4m3 with a scale per expert's output row (:func:`quantize_rows`'s)."""
    experts, out, inputs = weight.shape
    q, scale = quantize_rows(weight.reshape(experts * out, inputs))
    return Fp8Stack(q.view(experts, out, inputs), scale.view(experts, out, 1))


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, stride_x, n_cols, INV_FP8_LARGEST: tl.constexpr, TINY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row of ``x``: its scale ``max(|x|) * INV_FP8_LARGEST`` (at least ``TINY``) into ``scale_ptr[row]``,
        and ``x / scale`` rounded to nearest into ``q``'s row (contiguous, ``n_cols`` wide). The product and the
        divisions are fp32's, the divisions IEEE's (``div_rn``) as PyTorch's, so the scales and the rounded row are
        the ones :func:`_quantize_torch` makes."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        src = x_ptr + row * stride_x
        largest = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n_cols, other=0.0)
            largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(largest, axis=0) * INV_FP8_LARGEST, TINY)
        tl.store(scale_ptr + row, scale)
        dst = q_ptr + row * n_cols
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(src + start + cols, mask=mask, other=0.0).to(tl.float32)
            scales = tl.full([BLOCK], 0.0, tl.float32) + scale
            tl.store(dst + start + cols, tl.math.div_rn(x, scales).to(q_ptr.dtype.element_ty), mask=mask)


def _quantize_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` [M, K] at its own scale: e4m3 [M, K] and the scales [M, 1] fp32 (PyTorch's ops)."""
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() * _INV_FP8_MAX).clamp_min(_TINY)
    return (rows.float() / x_scale).to(FP8, memory_format=torch.contiguous_format), x_scale


def _quantize_triton(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_torch` in one launch of :func:`_quantize_rows_kernel` (CUDA; the CPU under the interpreter)."""
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8, device=rows.device)
    x_scale = torch.empty(m, 1, dtype=torch.float32, device=rows.device)
    assert rows.stride(1) == 1
    _quantize_rows_kernel[(m,)](
        rows,
        q,
        x_scale,
        rows.stride(0),
        k,
        INV_FP8_LARGEST=_INV_FP8_MAX,
        TINY=_TINY,
        BLOCK=_QUANTIZE_BLOCK,
        num_warps=4,
    )
    return q, x_scale


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` [M, K] (stride 1 along K) at its own scale: e4m3 [M, K] (row-major, as ``_scaled_mm``'s
    first operand must be) and the scales [M, 1] fp32. One Triton launch on CUDA, PyTorch's ops elsewhere."""
    if rows.device.type == "cuda" and triton is not None and rows.stride(1) == 1:
        return _quantize_triton(rows)
    return _quantize_torch(rows)


def _product_scaled_after(
    q: torch.Tensor, weight_t: torch.Tensor, x_scale: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``q @ weight_t`` scaled by ``x_scale`` [M, 1] and ``scale`` [1, N]: the product with unit scales (one per
    tensor, which every cuBLASLt with FP8 takes) into fp32, then the scales, then ``out_dtype``."""
    one = torch.ones((), dtype=torch.float32, device=q.device)
    raw = torch._scaled_mm(q, weight_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return raw.mul_(x_scale).mul_(scale).to(out_dtype)


def scaled_product(
    q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(q * x_scale) @ (weight * scale.T).T`` into ``out_dtype``: ``q`` [M, K] e4m3 row-major, ``weight`` [N, K]
    e4m3 row-major (its transpose the column-major operand), ``x_scale`` [M, 1] and ``scale`` [1, N] fp32."""
    shape = (q.shape[0], q.shape[1], weight.shape[0])
    if shape not in ROWWISE_REFUSED:
        try:
            return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale, out_dtype=out_dtype)
        except RuntimeError as e:
            if "CUBLAS_STATUS_NOT_SUPPORTED" not in str(e):
                raise
            ROWWISE_REFUSED.add(shape)
            log.warning("fp8: cuBLASLt refused scales per row for (M, K, N) = %s; scaling after the product", shape)
    return _product_scaled_after(q, weight.t(), x_scale, scale, out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    widened: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with ``x`` quantized per token: ``weight`` [out, in] e4m3 (row-major, as
    ``_scaled_mm`` wants its transpose column-major), ``scale`` [1, out].

    ``widened`` (the CPU, in any dtype): the product with ``weight`` widened to fp32 (exactly: every e4m3 value
    is an fp32 one), taken by the native packed kernel: the quantized rows' product with it is scaled after, as
    :func:`_product_scaled_after` does, into ``x``'s dtype. PyTorch's CPU ``_scaled_mm`` scales both operands before
    an fp32 product whose sums it orders by the number of rows, so a row's product changed with the rows beside it (a
    decode's one, a verification chunk's five): speculation, or another batch, changed greedy tokens. The native
    kernel sums a row alike in any batch."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*shape[:-1], weight.shape[0])
    q, x_scale = quantize_activations(rows)
    if widened is not None and rows.device.type == "cpu":
        out = widened(q.float()).mul_(x_scale).mul_(scale).to(x.dtype)
    else:
        out = scaled_product(q, weight, x_scale, scale, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse ``--quantization`` where it cannot run: an unknown method; on CUDA, a GPU without FP8 tensor cores or a
    model not in bfloat16 (the products with a scale per row write bfloat16 there)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization: {quantization!r} is not applied here; one of {', '.join(QUANTIZATIONS)}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"--quantization fp8: this GPU (sm_{major}{minor}) has no FP8 products; sm_89 or later")
        if dtype != torch.bfloat16:
            raise ConfigError(f"--quantization fp8 on CUDA takes --dtype bfloat16 (the products write it), not {dtype}")
