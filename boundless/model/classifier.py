"""A model that scores its input instead of continuing it (``/classify``, ``/score``, ``/rerank``; ``LLM.classify``,
``LLM.score``), as vLLM serves them: its prompt's last hidden state after the final norm, through a linear head of one
row a label.

Two kinds of checkpoint carry such a head:

- a ``*ForSequenceClassification`` one (cross-encoders and rerankers of the Llama and Qwen families): its
  ``score.weight`` ``[labels, hidden]`` beside the base model's tensors, its labels in ``config.json``'s ``id2label``;
- a causal LM whose head's rows for a few tokens are the scores, named by vLLM's ``classifier_from_token`` (through
  ``--hf-overrides``): Qwen3-Reranker answers "yes" or "no", and its relevance is ``logit(yes) - logit(no)`` (two tokens
  make one label, the second's logit less the first's, as vLLM reads them; any other number of tokens, a label each).

One label is a relevance, its score the sigmoid of its logit; more are classes, their probabilities the softmax
(vLLM's defaults; ``config.json`` may say otherwise: a regression's or an Identity ``activation_fn``'s score is the
logit itself, a multi-label classifier's a sigmoid a label). A pair is the tokenizer's pair encoding, as transformers'
``tokenizer(text, text_pair)`` (a ``classifier_from_token`` model's, the two texts as one, vLLM's rule for them: its
prompt template runs across them).
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
    activation: str = ""  # "sigmoid", "softmax" or "none" (the logits as they are); "": vLLM's default by labels


def classifier_spec(config: dict[str, Any]) -> ClassifierSpec | None:
    """The classifier ``config`` describes, or None for a model that generates or embeds."""
    tokens = config.get("classifier_from_token")
    if tokens:
        tokens = tuple(str(t) for t in tokens)
        # (vLLM's method: two tokens make one label, as Qwen3-Reranker's, unless "no_post_processing" keeps each.)
        difference = len(tokens) == 2 and config.get("method") != "no_post_processing"
        return ClassifierSpec(tokens[1:] if difference else tokens, tokens)
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    return ClassifierSpec(labels, activation=_activation(config))


def _activation(config: dict[str, Any]) -> str:
    """A sequence classifier's activation as its config says (sentence-transformers' CrossEncoder ``activation_fn``,
    transformers' ``problem_type``), else "" (vLLM's default)."""
    st = config.get("sentence_transformers") or {}
    function = str(st.get("activation_fn") or config.get("sbert_ce_default_activation_function") or "")
    if function.endswith("Identity"):
        return "none"
    if function.endswith("Sigmoid"):
        return "sigmoid"
    problem = config.get("problem_type")
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification":
        return "sigmoid"
    return ""


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
        found = tokenizer.token_to_id(token)  # (a token as the vocabulary writes it, as vLLM looks it up)
        encoded = [found] if found is not None else tokenizer.encode(token, add_special_tokens=False)
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


def pair_ids(tokenizer: Any, text: str, pair: str, joined: bool, max_length: int | None) -> list[int]:
    """A scored pair's token ids (see the module docstring), at most ``max_length`` of them where given: a pair's
    longer text loses its last tokens first, the two texts as one their last."""
    if joined:
        ids = tokenizer.encode(text + pair)
        return ids if max_length is None else ids[:max_length]
    return tokenizer.encode_pair(text, pair, max_length)


def scores(logits: list[float], activation: str = "") -> list[float]:
    """A classifier's scores of its logits: by ``activation``, else one label's sigmoid, more labels' softmax."""
    values = torch.tensor(logits, dtype=torch.float32)
    activation = activation or ("sigmoid" if len(logits) == 1 else "softmax")
    if activation == "none":
        return values.tolist()
    return (torch.sigmoid(values) if activation == "sigmoid" else torch.softmax(values, dim=-1)).tolist()
