"""Logprobs as the engine reports them: a token's log-probability under the model's raw distribution (no temperature,
penalties or grammar, as vLLM reports them), its rank, and the most likely alternatives; for sampled tokens and for
the prompt's own tokens (``SamplingParams.prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# Rows of prompt logits made at once when a chunk's prompt is scored: [rows, vocab] fp32 each time (50 MB for a
# 49 K vocabulary), not a whole chunk's (up to the step's token budget: GBs).
PROMPT_ROWS_PER_HEAD_CALL = 256


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the token under the model's raw distribution
    rank: int | None = None  # 1 = the most likely token
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


# A prompt's logprobs, vLLM's shape: one entry per prompt token, None for the first (nothing predicts it).
PromptLogprobs = list[SampledToken | None]


@dataclass(frozen=True)
class PromptSpan:
    """Rows of a step's flat hidden states that score prompt tokens: row ``first_row + j`` predicts
    ``targets[j]``, the prompt's token ``first_target + j``; ``top_k`` alternatives each."""

    request_id: str
    first_row: int
    targets: Sequence[int]
    first_target: int
    top_k: int


@dataclass(frozen=True)
class PromptScores:
    """A step's scores of one request's prompt tokens, from its token ``first`` on."""

    first: int
    tokens: list[SampledToken]


def score_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, top_ks: Sequence[int]) -> list[SampledToken]:
    """Each row's token (``token_ids``, long [rows]) with its logprob and rank under ``logprobs`` [rows, vocab], and
    the row's ``top_ks[i]`` most likely tokens (one copy to the host for all rows)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = max(top_ks, default=0)
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    out = []
    for j, (token, logprob, rank) in enumerate(
        zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), strict=True)
    ):
        n = top_ks[j]
        top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else []
        out.append(SampledToken(token, logprob, rank, top))
    return out


def score_prompt_spans(
    hidden: torch.Tensor, spans: Sequence[PromptSpan], lm_head: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, PromptScores]:
    """The prompt tokens the spans' rows of ``hidden`` [tokens, hidden] predict, scored with the LM head
    (``lm_head``: hidden rows to fp32 logits), a slice of rows at a time."""
    device = hidden.device
    rows = [s.first_row + j for s in spans for j in range(len(s.targets))]
    targets = [t for s in spans for t in s.targets]
    top_ks = [s.top_k for s in spans for _ in s.targets]
    scored: list[SampledToken] = []
    for lo in range(0, len(rows), PROMPT_ROWS_PER_HEAD_CALL):
        hi = lo + PROMPT_ROWS_PER_HEAD_CALL
        logits = lm_head(hidden[torch.tensor(rows[lo:hi], dtype=torch.long, device=device)])
        tokens = torch.tensor(targets[lo:hi], dtype=torch.long, device=device)
        scored += score_tokens(torch.log_softmax(logits, dim=-1), tokens, top_ks[lo:hi])
    out = {}
    at = 0
    for span in spans:
        out[span.request_id] = PromptScores(span.first_target, scored[at : at + len(span.targets)])
        at += len(span.targets)
    return out
