"""Logprobs as the engine reports them: a token's log-probability under the model's raw distribution (no temperature,
penalties or grammar, as vLLM reports them), its rank, and the most likely alternatives; for sampled tokens and for
the prompt's own tokens (``SamplingParams.prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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


# A prompt's logprobs, as the engine reports them: one entry per prompt token, None for the first (nothing predicts it).
PromptLogprobs = list[SampledToken | None]


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank (1: the most likely) and its text alone (None when the
    request asked for no text: ``SamplingParams.detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape of one position's logprobs: by token id, the position's own token first, then its top alternatives.
PositionLogprobs = dict[int, Logprob]


def as_position_logprobs(
    scored: Sequence[SampledToken | None], texts: Mapping[int, str] | None
) -> list[PositionLogprobs | None]:
    """The engine's scored tokens in vLLM's shape (``CompletionOutput.logprobs``, ``RequestOutput.prompt_logprobs``),
    each token's text from ``texts`` (by token id; None: no text)."""
    texts = texts or {}
    out: list[PositionLogprobs | None] = []
    for s in scored:
        if s is None:
            out.append(None)
            continue
        position = {s.token_id: Logprob(_as_float(s.logprob), s.rank, texts.get(s.token_id))}
        for rank, (tid, lp) in enumerate(s.top_logprobs, 1):
            position.setdefault(tid, Logprob(lp, rank, texts.get(tid)))
        out.append(position)
    return out


def named_tokens(scored: Iterable[SampledToken | None]) -> set[int]:
    """Every token id the scored tokens name: their own and their alternatives'."""
    return {tid for s in scored if s is not None for tid in (s.token_id, *(t for t, _ in s.top_logprobs))}


def _as_float(logprob: float | None) -> float:
    # (A scored token always has its logprob; None would be a token the model gave no probability.)
    return float("-inf") if logprob is None else logprob


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


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """The most alternatives a request may ask for: ``--max-logprobs`` (-1: the whole vocabulary), never past the
    vocabulary (a step's top-k of more failed, and with it every request of the step)."""
    return vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)


def score_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, top_ks: Sequence[int]) -> list[SampledToken]:
    """Each row's token (``token_ids``, long [rows]) with its logprob and rank under ``logprobs`` [rows, vocab], and
    the row's ``top_ks[i]`` most likely tokens (one copy to the host for all rows)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = min(max(top_ks, default=0), logprobs.shape[-1])
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
