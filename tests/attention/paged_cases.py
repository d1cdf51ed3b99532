"""Paged-attention test cases: sequences whose cached prefix is scattered over random blocks, with
their new tokens' q/k/v and a float64 dense reference (output and log-sum-exp)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from boundless.attention.backend import AttentionBatch


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
) -> PagedCase:
    """``chunks`` are (query_len, context_len) per sequence, decodes (query_len 1) first."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    blocks_each = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(blocks_each) + 3
    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    tables, qs, ks, vs, slots, outs, lses = [], [], [], [], [], [], []
    g = heads // kv_heads
    for (ql, ctx), nb in zip(chunks, blocks_each, strict=True):
        table = [free.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx - ql):
            k_cache[:, table[p // block_size], p % block_size] = k[p]
            v_cache[:, table[p // block_size], p % block_size] = v[p]
        q = torch.randn(ql, heads, head_dim, generator=gen).to(dtype)
        qs.append(q)
        ks.append(k[ctx - ql :])
        vs.append(v[ctx - ql :])
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - ql, ctx))
        kd = k.double().repeat_interleave(g, dim=1)
        vd = v.double().repeat_interleave(g, dim=1)
        for i in range(ql):
            pos = ctx - ql + i
            s = torch.einsum("hd,thd->ht", q[i].double(), kd[: pos + 1]) * head_dim**-0.5
            outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), vd[: pos + 1]))
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
