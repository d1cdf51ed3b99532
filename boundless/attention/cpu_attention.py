"""Python face of ``cpu_attention.cpp``: paged attention partials read straight from the block table.

One call per layer computes the partial (m, e, o) of every query token of the step, decodes and
prefill chunks alike, without gathering blocks into a dense copy; the backend finishes with
:func:`~boundless.attention.partials.merge_partials` as for any other partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from boundless import native
from boundless.attention.backend import padded_table
from boundless.attention.partials import AttentionPartial
from boundless.kv.cache_dtype import FP8_DTYPES, store_rows, value_table
from boundless.native import F, I, L, P

_SIGNATURES = {
    "bl_attention_abi_version": (I, []),
    "bl_paged_attention": (None, [P, L, P, P, L, L, P, L, P, P, L, L, L, L, F, P, P, P, L, I, I, L, F]),
    "bl_paged_attention8": (None, [P, L, P, P, L, L, P, L, P, P, L, L, L, L, F, P, P, P, L, I, I, L, F, P]),
    "bl_store_kv": (None, [P, L, P, L, P, P, P, L, L, L, L]),
    "bl_store_and_attend": (
        None,
        [P, L, P, L, P, L, P, L, P, P, L, L, P, L, P, P, L, L, L, L, F, P, P, P, L, I, I, L, F],
    ),
}

# Query tokens of a prefill chunk per work item: their rows share the chunk's KV in cache.
PREFILL_TILE = 8


_SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def _lib():
    return native.load("cpu_attention", _SOURCE, _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def supports(head_dim: int, device: torch.device) -> bool:
    return device.type == "cpu" and head_dim % 8 == 0 and available()


@dataclass
class NativeBatch:
    """The step's layout in the kernel's terms (int32, on the CPU)."""

    tables: torch.Tensor  # [seqs, max_blocks]
    q_starts: torch.Tensor  # [seqs + 1]
    seq_lens: torch.Tensor  # [seqs]
    num_tokens: int
    tile: int


def make_batch(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]) -> NativeBatch:
    width = max(1, max((len(t) for t in block_tables), default=1))
    tables = torch.tensor(padded_table(block_tables, width), dtype=torch.int32).view(len(block_tables), width)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    tile = PREFILL_TILE if max(query_lens, default=1) > 1 else 1
    return NativeBatch(
        tables=tables,
        q_starts=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_tokens=starts[-1],
        tile=tile,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``k``, ``v`` [tokens, kv_heads, head_dim] (heads contiguous) to their ``slots`` of the
    caches [kv_heads, blocks, block_size, head_dim]."""
    kvh, nb, bs, d = k_cache.shape
    assert k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.long
    slots = slots.contiguous()
    _lib().bl_store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k.shape[0],
        kvh,
        nb * bs,
        d,
    )


def paged_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: NativeBatch,
    scale: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> AttentionPartial:
    """The partial of every query row of ``q`` [tokens, heads, head_dim] over its sequence's
    context in the caches [kv_heads, blocks, block_size, head_dim] (causal within a chunk; within ``window`` keys
    of each row's position, the backends' rule, when given; each scaled score capped at ``softcap``, Gemma 2's
    ``softcap * tanh(score / softcap)``, when given)."""
    t, h, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and t == batch.num_tokens
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if out is None:
        o = torch.empty(t, h, d, dtype=torch.float32)
        m = torch.empty(t, h, 1, dtype=torch.float32)
        e = torch.empty(t, h, 1, dtype=torch.float32)
    else:
        o, m, e = out
    _attend(_attention_args(q, k_cache, v_cache, batch, scale, o, m, e, False, window, softcap), k_cache.dtype)
    return AttentionPartial(m=m, e=e, o=o)


def _attend(args: tuple, cache_dtype: torch.dtype) -> None:
    """The kernel over fp32 caches, or over 8-bit ones (``--kv-cache-dtype fp8``) widened through their values'
    table."""
    if cache_dtype in FP8_DTYPES:
        _lib().bl_paged_attention8(*args, value_table(cache_dtype).data_ptr())
    else:
        _lib().bl_paged_attention(*args)


def store_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    batch: NativeBatch,
    scale: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    normalize: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> AttentionPartial:
    """:func:`store_kv` then :func:`paged_partial`, in one call (the layout checks are the caller's:
    heads contiguous in q, k, v; contiguous caches; int64 slots). With ``normalize`` the partial's
    ``o`` is finished in place into the attention output ``o / e``, for a caller with nothing to merge."""
    o, m, e = out
    if k_cache.dtype in FP8_DTYPES:  # (rounded on the way in by PyTorch's cast; the kernel stores fp32 only)
        store_rows(k, v, k_cache, v_cache, slots)
        args = _attention_args(q, k_cache, v_cache, batch, scale, o, m, e, normalize, window, softcap)
        _attend(args, k_cache.dtype)
        return AttentionPartial(m=m, e=e, o=o)
    _lib().bl_store_and_attend(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), q.shape[0],
        *_attention_args(q, k_cache, v_cache, batch, scale, o, m, e, normalize, window, softcap),
    )  # fmt: skip
    return AttentionPartial(m=m, e=e, o=o)


def _attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: NativeBatch,
    scale: float,
    o: torch.Tensor,
    m: torch.Tensor,
    e: torch.Tensor,
    normalize: bool,
    window: int | None,
    softcap: float | None = None,
) -> tuple:
    """The attention arguments the kernel's entry points share, in their order."""
    h, d = q.shape[1:]
    kvh, nb, bs, _ = k_cache.shape
    return (
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), nb, bs,
        batch.tables.data_ptr(), batch.tables.shape[1], batch.q_starts.data_ptr(), batch.seq_lens.data_ptr(),
        batch.tables.shape[0], h, kvh, d, scale, o.data_ptr(), m.data_ptr(), e.data_ptr(), batch.tile, int(normalize),
        native.threads(), window or 0, softcap or 0.0,
    )  # fmt: skip
