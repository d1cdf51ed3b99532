"""The fused Triton kernels of the GPU layer path against the PyTorch path they replace: RMSNorm (with
and without the residual add), the rotary embedding in place on a strided view of the fused qkv rows,
and SiLU(gate) * up; fp32 and fp16 (on the CPU in Triton's interpreter), and bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boundless.attention import triton_paged
from boundless.model.arch import ModelArch, RopeScaling
from boundless.model.llama import RMSNorm
from boundless.model.rope import RotaryEmbedding, apply_rotary_

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_paged.available(DEVICE), reason="triton unavailable")
if triton_paged.available(DEVICE):
    from boundless.model import triton_ops

# The interpreter rounds fp32 to bf16 by truncation (a GPU rounds to nearest even): bf16 waits for a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # The same rounding steps; only the fp32 sum of squares may associate differently, which can move a
    # rounding by one unit in the last place, and the weight's product by one more.
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fp32_weight", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [64, 576, 100])
def test_rms_norm_matches_the_module(dtype: torch.dtype, cols: int, fp32_weight: bool) -> None:
    """Llama's norm (the normalized row rounded before the weight) and Gemma's (its weight kept in fp32 when the model
    is cast, the product rounded once)."""
    g = torch.Generator().manual_seed(cols)
    norm = RMSNorm(cols, 1e-5, fp32_weight).to(dtype)
    assert norm.weight.dtype == (torch.float32 if fp32_weight else dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(cols, generator=g))
    x = (3 * torch.randn(7, cols, generator=g)).to(dtype)
    delta = torch.randn(7, cols, generator=g).to(dtype)
    on_device = RMSNorm(cols, 1e-5, fp32_weight).to(dtype).to(DEVICE)
    with torch.no_grad():
        on_device.weight.copy_(norm.weight)
        _close(on_device.fused(x.to(DEVICE)).cpu(), norm(x), dtype)
        residual = x.clone().to(DEVICE)
        out = on_device.fused(residual, delta.to(DEVICE))
        expected_residual = x + delta  # the reference's residual add, in the dtype
        _close(residual.cpu(), expected_residual, dtype)
        _close(out.cpu(), norm(expected_residual), dtype)


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["whole", "partial"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_on_fused_qkv_rows(dtype: torch.dtype, partial: float) -> None:
    """Each q and k head rotated in place (a Phi-4-mini's leading 3/4 of it: the kernel on a view of them)."""
    heads, kv_heads, d, t = 4, 2, 32, 9
    arch = ModelArch.from_hf_config(
        {"model_type": "phi3", "hidden_size": heads * d, "num_attention_heads": heads,
         "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8,
         "max_position_embeddings": 64, "partial_rotary_factor": partial}
    )  # fmt: skip
    assert arch.rope_scaling == RopeScaling()
    r = arch.rotary_dim
    rope = RotaryEmbedding(arch, 64, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 2, 30, 7, 7, 44])
    rotated = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    expected = qkv.clone()
    # The Hugging Face reference: q * cos + rotate_half(q) * sin over the rotated dimensions, each product in the
    # dtype; the rest of each head as it was.
    ref = rotated.clone()
    cos = torch.cat([rope.cos[positions]] * 2, dim=-1).unsqueeze(1)
    sin = torch.cat([rope.sin[positions]] * 2, dim=-1).unsqueeze(1)
    half = r // 2
    part = ref[..., :r]
    rotate_half = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    ref[..., :r] = part * cos + rotate_half * sin
    expected[:, : (heads + kv_heads) * d] = ref.reshape(t, -1)
    got = qkv.clone().to(DEVICE)
    view = got[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    triton_ops.rotary_(view[..., :r], positions.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    assert torch.equal(got[:, (heads + kv_heads) * d :].cpu(), qkv[:, (heads + kv_heads) * d :])  # v untouched
    assert torch.equal(view[..., r:].cpu(), rotated[..., r:])  # (and the heads' unrotated dimensions)
    _close(got.cpu(), expected, dtype)  # q and k rotated as the reference rounds
    # And the PyTorch path of this package agrees within its own rounding.
    ours = rotated.clone()
    apply_rotary_(ours[..., :r], rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))
    _close(view.cpu(), ours, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(5, 2 * 1500, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # in the dtype, as the reference computes it
    _close(triton_ops.silu_mul(gate_up.to(DEVICE)).cpu(), expected, dtype)
