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
from typing import Any

import torch

from boundless.attention.backend import soft_cap

# Upper bound on the elements of one score tile on the matmul path (64 MiB in fp32).
_MAX_SCORE_ELEMENTS = 1 << 24
_TINY = {dt: torch.finfo(dt).tiny for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


@dataclass
class AttentionPartial:
    """``m`` and ``e`` are [..., 1]; ``o`` is [..., head_dim]; leading dims index (query, head)."""

    m: torch.Tensor
    e: torch.Tensor
    o: torch.Tensor

    def to(self, device: torch.device) -> AttentionPartial:
        """The partial on ``device`` (a creditor's reply lands in host memory; a GPU debtor merges on its GPU)."""
        if self.o.device == device:
            return self
        return AttentionPartial(m=self.m.to(device), e=self.e.to(device), o=self.o.to(device))


def partial_from_lse(out: torch.Tensor, lse: torch.Tensor) -> AttentionPartial:
    """A normalized output [rows, heads, head_dim] and its log-sum-exp [rows, heads] (a fused kernel's) as a partial:
    the log-sum-exp is its max (``m``) and its sum 1 (``e``); a row that attended to nothing (-inf) is an empty partial
    (``e`` = 0)."""
    lse = lse.unsqueeze(-1)
    seen = torch.isfinite(lse)
    return AttentionPartial(m=lse.nan_to_num(neginf=0.0), e=seen.to(lse.dtype), o=out)


class PartialsFromLse:
    """``forward_partial`` for a backend whose ``forward`` leaves each row's log-sum-exp in ``meta.lse`` (a fused
    kernel's): its output as one partial per row, for DistAttention to merge with partials computed elsewhere."""

    def forward_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        window: int | None = None,
    ) -> AttentionPartial:
        out = self.forward(q, k, v, cache, meta, window)  # type: ignore[attr-defined]
        assert meta.lse is not None
        return partial_from_lse(out, meta.lse)


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


def scores_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
) -> AttentionPartial:
    """The partial of ``q`` [N, L, D] over ``k``, ``v`` [N, S, D].

    ``bias`` [N or 1, L, S] is added to the scores (0 or -inf); ``causal`` masks position j > i
    (for L == S); ``softcap`` caps the scaled scores first (Gemma 2's ``softcap * tanh(score / softcap)``). On the
    CPU this is PyTorch's fused flash-attention kernel, which returns the log-sum-exp of the scores: a partial with
    ``m = lse`` and ``e = 1``. Elsewhere, or with a cap (which that kernel has not), it is computed with matmuls and
    :func:`softmax_partial`, in query tiles of bounded memory.
    """
    n, length, d = q.shape
    if q.device.type == "cpu" and not softcap:
        mask = None if bias is None else bias.to(q.dtype).expand(n, -1, -1).unsqueeze(1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.view(n, length, 1)
        # A fully masked row has a zero output and an lse of -inf, or of 0 (PyTorch 2.13's kernel): an empty partial
        # (e = 0) either way.
        seen = lse > float("-inf")
        if bias is not None:
            seen &= ~bias.isneginf().all(dim=-1, keepdim=True)
        e = seen.to(lse.dtype)
        return AttentionPartial(m=lse.nan_to_num(neginf=0.0), e=e, o=out.view(n, length, d))
    if causal:
        causal_bias = torch.zeros(length, k.shape[1], device=q.device).masked_fill_(
            torch.ones(length, k.shape[1], dtype=torch.bool, device=q.device).triu_(1), float("-inf")
        )
        bias = causal_bias.unsqueeze(0) if bias is None else bias + causal_bias
    tile = max(1, _MAX_SCORE_ELEMENTS // max(1, n * k.shape[1]))
    parts = []
    for start in range(0, length, tile):
        end = min(length, start + tile)
        scores = torch.bmm(q[:, start:end], k.transpose(1, 2)).mul_(scale)
        if softcap:
            scores = soft_cap(scores, softcap)
        if bias is not None:
            scores = scores + bias[:, start:end]
        parts.append(softmax_partial(scores, v))
    if len(parts) == 1:
        return parts[0]
    return AttentionPartial(
        m=torch.cat([p.m for p in parts], dim=1),
        e=torch.cat([p.e for p in parts], dim=1),
        o=torch.cat([p.o for p in parts], dim=1),
    )


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


def merge_partials(parts: Sequence[AttentionPartial], out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output: the merged partial's ``o / e`` (zero where nothing was attended),
    written into ``out`` when given."""
    merged = combine_partials(parts)
    e = merged.e.clamp_min(_TINY.get(merged.e.dtype) or torch.finfo(merged.e.dtype).tiny)
    return torch.div(merged.o, e if e.dtype == merged.o.dtype else e.to(merged.o.dtype), out=out)


def merge_with_sinks(part: AttentionPartial, sinks: torch.Tensor) -> torch.Tensor:
    """The attention output of ``part`` (rows [tokens, heads, ...]) with a sink per head (gpt-oss's): a learned logit
    ``sinks[h]`` in every row's softmax whose value is zero, so it only takes its share of the weight, ``o / (e +
    exp(sink - m))``. It is one more key of every row, merged once after the partials over every real key (local,
    lent) are; a row that attended to nothing is zero."""
    denominator = part.e + torch.exp(sinks.float().view(-1, 1) - part.m)
    return (part.o.float() / denominator).to(part.o.dtype)  # (in fp32: a large denominator overflows float16)
