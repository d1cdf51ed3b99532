"""Attention as a merge of partials.

Attention of a query over a set of KV positions can be split over any partition of those
positions. Over one part, a *partial* keeps the running max of the scores ``m``, the sum of
``exp(score - m)`` ``e``, and the unnormalized output ``o = sum(exp(score - m) * v)``. Partials
merge exactly (DistAttention, Infinite-LLM §4): rescale each to the common max and add. Local
paged attention is the case of one partial; attention over KV held by several instances is the
case of many, each computed where its KV lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionPartial:
    """``m`` and ``e`` are [..., 1]; ``o`` is [..., head_dim]; leading dims index (query, head)."""

    m: torch.Tensor
    e: torch.Tensor
    o: torch.Tensor


def softmax_partial(scores: torch.Tensor, v: torch.Tensor) -> AttentionPartial:
    """The partial of already-scaled, already-masked ``scores`` [N, Q, T] against ``v`` [N, T, D]."""
    scores = scores.float()  # softmax statistics in fp32 whatever the KV dtype
    m = scores.amax(dim=-1, keepdim=True)
    # A row with every position masked has m = -inf; it then contributes nothing, not NaN.
    m.nan_to_num_(neginf=0.0)
    p = torch.exp(scores - m)
    e = p.sum(dim=-1, keepdim=True)
    o = torch.bmm(p.to(v.dtype), v)
    return AttentionPartial(m=m, e=e, o=o)


def combine_partials(parts: Sequence[AttentionPartial]) -> AttentionPartial:
    """Merge partials over disjoint KV sets into the partial over their union."""
    if len(parts) == 1:
        return parts[0]
    m = parts[0].m
    for p in parts[1:]:
        m = torch.maximum(m, p.m)
    e = torch.zeros_like(parts[0].e)
    o = torch.zeros_like(parts[0].o)
    for p in parts:
        scale = torch.exp(p.m - m)
        e = e + p.e * scale
        o = o + p.o * scale.to(o.dtype)
    return AttentionPartial(m=m, e=e, o=o)


def merge_partials(parts: Sequence[AttentionPartial]) -> torch.Tensor:
    """The attention output: the merged partial's ``o / e`` (zero where nothing was attended)."""
    merged = combine_partials(parts)
    e = merged.e.clamp_min(torch.finfo(merged.e.dtype).tiny)
    return merged.o / e.to(merged.o.dtype)
