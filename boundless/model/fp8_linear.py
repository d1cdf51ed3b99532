"""FP8 matrix products (``--quantization fp8``, vLLM's online FP8): a layer's weights held in e4m3, one scale per
output row, and each product's activations quantized per token as it runs (dynamic scales), multiplied by
``torch._scaled_mm`` into the model's type.

Why: a decode step reads every weight once, so its time is the weights' bytes over the memory's bandwidth; in fp8 a
16-bit model's layers are half the bytes (an 8B model's 15 GB, 7.5 GB). On a GPU with FP8 tensor cores (sm_89 and
later: Ada, Hopper) the product itself is native. Rows of the weight and of the activations each get their own scale
(the finest ``_scaled_mm`` takes), which keeps an outlier row from flattening the rest. The embedding, the LM head,
the norms and a mixture's experts stay in the model's type, as vLLM keeps them.

On the CPU PyTorch's fp8 product is a reference implementation, many times slower than an fp32 one: it runs and is
tested there, but it is for GPUs.
"""

from __future__ import annotations

import torch

from boundless.config import QUANTIZATIONS, ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
_TINY = 1e-12  # a row of zeros gets this scale, not a division by zero


def quantizable(weight: torch.Tensor) -> bool:
    """Whether ``_scaled_mm`` takes this [out, in] weight: both sides multiples of 16 (CUDA's kernels ask it)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as e4m3 and its scales [1, out] in fp32 (``weight[r] ~= q[r] * scale[0, r]``)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return (w / scale).to(FP8), scale.t().contiguous()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with ``x`` quantized per token: ``weight`` [out, in] e4m3 (row-major, as
    ``_scaled_mm`` wants its transpose column-major), ``scale`` [1, out]."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*shape[:-1], weight.shape[0])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(_TINY)
    q = (rows.float() / x_scale).to(FP8)
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale, out_dtype=x.dtype)
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
