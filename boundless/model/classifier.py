"""A model that scores its input instead of continuing it (``/classify``, ``/score``, ``/rerank``; ``LLM.classify``,
``LLM.score``), as vLLM serves them: its prompt's last hidden state after the final norm, through a linear head of one
row a label.

Two kinds of checkpoint carry such a head:

- a ``*ForSequenceClassification`` one (cross-encoders and rerankers of the Llama and Qwen families): its
  ``score.weight`` ``[labels, hidden]`` beside the base model's tensors, its labels in ``config.json``'s ``id2label``;
- a causal LM whose head's rows for a few tokens are the scores, named by vLLM's ``classifier_from_token`` (through
  ``--hf-overrides``): Qwen3-Reranker answers "yes" or "no", and its relevance is ``logit(yes) - logit(no)`` (two tokens
  make one label, the second's logit less the first's, as vLLM reads them; any other number of tokens, a label each).

One label is a relevance, its score the sigmoid of its logit; more are classes, their probabilities the softmax.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from boundless.config import ConfigError

SCORE_WEIGHT = "score.weight"


@dataclass(frozen=True)
class ClassifierSpec:
    """What ``config.json`` says of a classifier: its labels, and the tokens whose head rows make its head (None: a
    ``score.weight`` in the checkpoint)."""

    labels: tuple[str, ...]
    from_tokens: tuple[str, ...] | None = None


def classifier_spec(config: dict[str, Any]) -> ClassifierSpec | None:
    """The classifier ``config`` describes, or None for a model that generates or embeds."""
    tokens = config.get("classifier_from_token")
    if tokens:
        tokens = tuple(str(t) for t in tokens)
        return ClassifierSpec(tokens[1:] if len(tokens) == 2 else tokens, tokens)
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 2)
    return ClassifierSpec(tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)))


class ScoreWeight:
    """Takes a ``*ForSequenceClassification`` checkpoint's head out of its stream of tensors (the network loads the
    rest)."""

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None

    def take(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name == SCORE_WEIGHT:
                self.weight = tensor
            else:
                yield name, tensor


def head_from_tokens(head: torch.Tensor, tokenizer: Any, tokens: tuple[str, ...]) -> torch.Tensor:
    """``classifier_from_token``'s head from the LM head's rows ``[vocab, hidden]`` (see the module docstring)."""
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(f"--hf-overrides: classifier_from_token {token!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    rows = head[torch.tensor(ids, device=head.device)].float()
    return (rows[1] - rows[0]).unsqueeze(0) if len(ids) == 2 else rows


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairs of ``/score`` and ``LLM.score``: ``text_1`` (one text, or as many as ``text_2``) against each of
    ``text_2``, in order (ValueError otherwise)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds):
        raise ValueError(f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: one, or as many as text_2")
    return list(zip(firsts, seconds, strict=True))


def scores(logits: list[float]) -> list[float]:
    """A classifier's scores of its logits: one label's sigmoid, more labels' softmax."""
    values = torch.tensor(logits, dtype=torch.float32)
    return (torch.sigmoid(values) if len(logits) == 1 else torch.softmax(values, dim=-1)).tolist()
