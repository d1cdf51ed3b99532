"""The type the KV cache holds its keys and values in (``--kv-cache-dtype``), and the casts into and out of it.

``auto`` keeps the model's type; ``bfloat16`` halves an fp32 model's KV. The fp8 types (vLLM's names: ``fp8`` is
``fp8_e4m3``) halve a 16-bit model's KV memory and quarter an fp32 one's, so a pool holds two or four times the
tokens: longer contexts, more sequences at once. Keys and values are stored as they are, with no scale (vLLM's
default scale of 1.0 where the checkpoint gives none), saturated at the type's largest finite value: e4m3 (3
mantissa bits, up to 448) where values are small, as a model's keys and values are; e5m2 (2 mantissa bits, up to
57,344) for wider ones. Attention reads them back into the queries' type, so every score and sum is still computed
in the model's precision; only the stored values are rounded. Outputs then differ from the model's own by that
rounding (measured in ``docs/engine.md``).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's choices
_NAMED = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's type for ``--kv-cache-dtype name`` with the model in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name not in _NAMED:
        raise ValueError(f"unknown KV cache dtype {name!r}; one of {', '.join(KV_CACHE_DTYPES)}")
    return _NAMED[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache holds it: cast, and for fp8 first clamped to the type's finite range (PyTorch's cast
    makes a NaN of what lies past it, which would poison every later score of the sequence)."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``x`` in the type attention computes in (the queries')."""
    return x if x.dtype == dtype else x.to(dtype)


def index_copy(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(dim, index, src)`` for KV in any of the cache's types: PyTorch's CPU kernel has none for the
    8-bit ones, so those move as their bytes (the same size, the same layout)."""
    src = src.to(device=dst.device, dtype=dst.dtype)
    if dst.dtype in FP8_DTYPES:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(dim, index, src)


def store_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """A step's K/V [tokens, kv_heads, head_dim] into one layer's caches [kv_heads, blocks, block_size, head_dim] at
    ``slots``, in the caches' type."""
    kvh, nb, bs, d = k_cache.shape
    k_cache.view(kvh, nb * bs, d)[:, slots] = to_cache(k.transpose(0, 1), k_cache.dtype)
    v_cache.view(kvh, nb * bs, d)[:, slots] = to_cache(v.transpose(0, 1), v_cache.dtype)


def value_table(dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit type's 256 values in fp32, by byte: how a native kernel widens the cache (a lookup per byte)."""
    if dtype not in _TABLES:
        _TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return _TABLES[dtype]


_TABLES: dict[torch.dtype, torch.Tensor] = {}


def index_select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, index)`` for KV in any of the cache's types: 8-bit rows are gathered as their bytes, since
    not every build's CUDA ``index_select`` takes every float8 type (as ``index_copy`` moves them)."""
    if x.dtype in FP8_DTYPES:
        return x.view(torch.uint8).index_select(dim, index).view(x.dtype)
    return x.index_select(dim, index)
