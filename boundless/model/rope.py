"""Rotary position embeddings, with the scalings Llama-family checkpoints use."""

from __future__ import annotations

import math

import torch

from boundless.model.arch import ModelArch, RopeScaling


def uses_long_factors(scaling: RopeScaling, context: int) -> bool:
    """Whether an engine of a LongRoPE model whose context asked for is ``context`` rotates by the long factors:
    vLLM's rule, when that context is longer than the model's original one. (transformers picks by each sequence's
    length, and when a sequence grows past the original context it drops its cache and computes it all again by
    the long factors; one choice per engine keeps every block's keys valid as they are, and a cached prefix the same
    whatever follows it.)"""
    return scaling.kind == "longrope" and context > scaling.original_max_position_embeddings


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """Per-pair rotation frequencies of the ``rotary_dim`` rotated dimensions of a head, computed as transformers
    computes them (bit for bit). ``long``: LongRoPE's long factors, else its short ones."""
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if scaling.kind == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (factors * theta**shape)
    inv_freq = 1.0 / (theta**shape)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling.kind == "yarn":
        return _yarn_frequencies(rotary_dim, theta, scaling)
    return inv_freq


def _yarn_frequencies(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies (NTK-by-parts): those that turn fewer than ``beta_slow`` times over the original context
    interpolated by the factor, those that turn more than ``beta_fast`` times kept, a linear ramp between."""

    def correction_dim(rotations: float) -> float:  # the dimension that turns this many times over the context
        return (dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no empty ramp)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it is)
    return interpolation * (1 - kept) + extrapolation * kept


class RotaryEmbedding:
    """A cos/sin table for every position, looked up once per step and shared by all layers (or, ``local``, by the
    sliding-window layers of a model whose own RoPE base they have: Gemma 3's ``local_rope_theta``, unscaled). Its
    width is half the rotated dimensions (``ModelArch.rotary_dim``); a LongRoPE model's are by its long factors or
    its short ones (``long``: :func:`uses_long_factors`)."""

    def __init__(
        self,
        arch: ModelArch,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        local: bool = False,
        long: bool = False,
    ) -> None:
        scaling = RopeScaling() if local else arch.rope_scaling
        theta = arch.local_rope_theta if local else arch.rope_theta
        assert theta is not None, "a local table for a model with one RoPE"
        self.long = long and scaling.kind == "longrope"
        inv_freq = inverse_frequencies(arch.rotary_dim, theta, scaling, self.long)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        # YaRN and LongRoPE scale cos and sin (so q.k by the square) before they are cast, as transformers does (1
        # otherwise).
        scale = scaling.attention_factor
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, shaped [tokens, 1, rotary_dim / 2]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def interleaved_to_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A projection's output rows (a q or k weight [heads * head_dim, ...], its bias, a LoRA B) reordered within each
    head from RoPE's interleaved layout (pairs ``(2i, 2i + 1)`` rotate together: GLM-4's, GPT-J's) to the halves'
    (pairs ``(i, i + rotary_dim / 2)``): its rotated dimensions evens first, then odds; the rest as they were. q and
    k reordered alike give the same q.k, and the rotate-half kernels rotate them as the checkpoint's model does."""
    order = torch.cat(
        [torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head_dim)]
    )
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim] (the rotate-half layout of Hugging Face checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` in place, with no concatenation; ``x`` may be a strided view (q and k
    heads side by side in the fused qkv output rotate in one call)."""
    x1, x2 = x.chunk(2, dim=-1)
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).add_(x1_sin)
    return x
