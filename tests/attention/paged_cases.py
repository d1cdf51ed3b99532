"""Paged-attention test cases: sequences whose cached prefix is scattered over random blocks, with
their new tokens' q/k/v and a float64 dense reference (output and log-sum-exp)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from boundless.attention.backend import AttentionBatch
from boundless.kv.cache_dtype import to_cache

# The backends' cases: (heads, kv heads, head dim, block size), and steps of (query tokens, context) per sequence.
SHAPES = [
    # heads, kv heads, head dim, block size
    (8, 2, 64, 16),
    (4, 4, 16, 4),
    (6, 2, 24, 64),  # group of 3, head size 24, pages larger than a tile
]
MIXES = {
    "decodes": [(1, 1), (1, 17), (1, 200), (1, 64), (1, 33)],
    "prefills": [(37, 37), (5, 5), (70, 70)],
    "mixed": [(1, 70), (1, 3), (20, 20), (9, 40), (16, 16 + 16)],  # chunked prefill over a cached prefix
}


@dataclass
class PagedCase:
    batch: AttentionBatch
    cache: tuple[torch.Tensor, torch.Tensor]  # [kv_heads, blocks, block_size, head_dim] each
    q: torch.Tensor  # [tokens, heads, head_dim]
    k: torch.Tensor  # [tokens, kv_heads, head_dim]
    v: torch.Tensor
    expected: torch.Tensor  # [tokens, heads, head_dim] float64
    expected_lse: torch.Tensor  # [tokens, heads] float64

    def __iter__(self):
        """Unpacks as (batch, cache, q, k, v, expected, expected_lse)."""
        return iter((self.batch, self.cache, self.q, self.k, self.v, self.expected, self.expected_lse))


def paged_case(
    seed: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_dtype: torch.dtype | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> PagedCase:
    """``chunks`` are (query_len, context_len) per sequence, decodes (query_len 1) first. The cache holds K/V in
    ``kv_dtype`` (default ``dtype``: ``--kv-cache-dtype``), and the reference attends over them as it holds them.
    ``window``: the reference is sliding-window attention (a query at position p sees keys p - window < j <= p).
    ``scale`` (default ``head_dim ** -0.5``) scales the scores, which ``softcap`` caps (Gemma 2's)."""
    device = torch.device(device)
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    blocks_each = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(blocks_each) + 3
    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    tables, qs, ks, vs, slots, outs, lses = [], [], [], [], [], [], []
    g = heads // kv_heads
    for (ql, ctx), nb in zip(chunks, blocks_each, strict=True):
        table = [free.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx - ql):
            k_cache[:, table[p // block_size], p % block_size] = to_cache(k[p], kv_dtype)
            v_cache[:, table[p // block_size], p % block_size] = to_cache(v[p], kv_dtype)
        q = torch.randn(ql, heads, head_dim, generator=gen).to(dtype)
        qs.append(q)
        ks.append(k[ctx - ql :])
        vs.append(v[ctx - ql :])
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - ql, ctx))
        kd = to_cache(k, kv_dtype).double().repeat_interleave(g, dim=1)
        vd = to_cache(v, kv_dtype).double().repeat_interleave(g, dim=1)
        for i in range(ql):
            pos = ctx - ql + i
            lo = 0 if window is None else max(0, pos - window + 1)
            s = torch.einsum("hd,thd->ht", q[i].double(), kd[lo : pos + 1]) * (scale or head_dim**-0.5)
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), vd[lo : pos + 1]))
            lses.append(s.logsumexp(-1))
    batch = AttentionBatch(
        num_decodes=sum(1 for ql, _ in chunks if ql == 1),
        query_lens=[ql for ql, _ in chunks],
        seq_lens=[ctx for _, ctx in chunks],
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=block_size,
        device=device,
    )
    cache = (k_cache.to(device), v_cache.to(device))
    q, k, v = (torch.cat(x).to(device) for x in (qs, ks, vs))
    return PagedCase(batch, cache, q, k, v, torch.stack(outs), torch.stack(lses))


def fused_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v as the model hands them over: strided views into one fused projection's rows."""
    d = q.shape[-1]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    sizes = [q.shape[1] * d, k.shape[1] * d, v.shape[1] * d]
    return tuple(x.view(x.shape[0], -1, d) for x in qkv.split(sizes, dim=1))


def check_matches_dense(
    case: PagedCase, out: torch.Tensor, lse: torch.Tensor, tol: float, check_lse: bool = True
) -> None:
    """A step's output and log-sum-exp (with ``check_lse``) against ``case``'s dense reference, and its new tokens' K/V
    in the cache at their slots, as the cache holds them."""
    torch.testing.assert_close(out.double().cpu(), case.expected, rtol=tol, atol=tol)
    if check_lse:
        torch.testing.assert_close(lse.double().cpu(), case.expected_lse, rtol=tol, atol=tol)
    kvh, nb, bs, d = case.cache[0].shape
    slots = case.batch.slot_mapping
    kv_dtype = case.cache[0].dtype
    for cache, new in zip(case.cache, (case.k, case.v), strict=True):
        held = cache.view(kvh, nb * bs, d)[:, slots]
        assert torch.equal(held.view(torch.uint8), to_cache(new.transpose(0, 1), kv_dtype).view(torch.uint8))


def check_padding_row(make_backend: Callable[[int], Any], device: torch.device) -> None:
    """A CUDA graph's padded batch through a backend (``make_backend(num_blocks)``, of 4 heads over 2 KV heads of
    16, pages of 16): a decode row of context 0 and slot -1 after two real ones stores nothing, yields zeros and a
    log-sum-exp of -inf, and leaves the real rows' outputs as they are."""
    heads, kv_heads, d, bs = 4, 2, 16, 16
    case = paged_case(6, heads, kv_heads, d, bs, [(1, 20), (1, 7)], torch.float32, device)
    batch, cache = case.batch, case.cache
    before = [c.clone() for c in cache]
    padded = AttentionBatch(
        num_decodes=3,
        query_lens=[1, 1, 1],
        seq_lens=[*batch.seq_lens, 0],
        block_tables=[*batch.block_tables, []],
        slot_mapping=torch.cat([batch.slot_mapping, torch.tensor([-1], device=device)]),
        block_size=bs,
        device=device,
    )
    q, k, v = (torch.cat([x, torch.randn(1, *x.shape[1:], device=device)]) for x in (case.q, case.k, case.v))
    backend = make_backend(cache[0].shape[1])
    meta = backend.prepare(padded)
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(out[:2].double().cpu(), case.expected, rtol=2e-5, atol=2e-5)
    assert torch.equal(out[2].cpu(), torch.zeros(heads, d))
    assert meta.lse[2].eq(-math.inf).all()
    changed = (cache[0] != before[0]).any(dim=-1).nonzero()
    assert len(changed) == kv_heads * 2  # the two real tokens' slots, for every kv head
