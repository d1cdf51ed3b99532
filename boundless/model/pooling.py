"""How a model's hidden states make an embedding of a text (``/v1/embeddings``, ``LLM.embed``), as sentence-transformers
and vLLM read it from the model's directory.

A sentence-transformers model directory says so in ``modules.json``: a ``Pooling`` module (its ``config.json`` names
the pooling: ``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``) and, where the
embeddings are unit vectors, a ``Normalize`` module. Decoder embedding models (Qwen3-Embedding, gte-Qwen2,
e5-mistral) pool the last token and normalize; a directory without ``modules.json`` (any causal LM, a GGUF file) is
read the same way, as vLLM's default for them. (A checkpoint of the base model alone loads too: with its head tied to
its embedding, Qwen3-Embedding's, as any model; with no head at all, e5-mistral's, for embeddings only.)
``config.json``'s ``is_matryoshka`` or ``matryoshka_dimensions`` say that a prefix of the embedding is an embedding too
(the API's ``dimensions``). Modules after the pooling that change the vector (``Dense``) are not applied: such a model's
embeddings are refused, not served wrong.

The engine computes the last token's hidden state (after the final norm) as it computes the row it samples from; for
mean pooling it adds up every prompt token's as its chunks run (such a request takes no cached prefix: the hidden
states of cached tokens are not kept). Other poolings (CLS, max...) are refused when an embedding is asked for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# sentence-transformers' pooling modes, by its config's key, and their names here (vLLM's PoolingType, lowercase).
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weighted_mean",
}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's, for ``LLM.embed``: ``dimensions`` cuts a Matryoshka model's embeddings, ``normalize`` (None: as the
    model says) makes them of unit length or not (as the API's fields do)."""

    dimensions: int | None = None
    normalize: bool | None = None


# sentence-transformers modules that change no vector (the model itself; those that make or scale it are read).
_NEUTRAL_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class EmbeddingPooling:
    """How the model's hidden states pool into an embedding: ``kind`` (``last`` is served), unit length or not, whether
    a prefix of it is an embedding too (Matryoshka representation learning; ``dimensions``: the prefixes it was trained
    for, empty: any), and the sentence-transformers modules after the pooling that are not applied here (``Dense``...:
    an embedding without them would be another model's)."""

    kind: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    dimensions: tuple[int, ...] = ()
    unapplied: tuple[str, ...] = ()
    # A classifier's (``*ForSequenceClassification``, or vLLM's ``classifier_from_token``): its labels, by index; the
    # pooled state goes through its head (``LoadedModel.classifier``) to one score a label. Empty: an embedding model.
    labels: tuple[str, ...] = ()
    activation: str = ""  # a classifier's (``classifier.scores``)
    joins_pairs: bool = False  # a classifier's pairs are tokenized as one text (``classifier.pair_ids``)

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    @property
    def served(self) -> bool:
        return self.kind in ("last", "mean") and not self.unapplied

    def refusal(self) -> str:
        """Why the model's embeddings are not served (for its error)."""
        if self.unapplied:
            modules = ", ".join(self.unapplied)
            return f"the model's embeddings pass modules not applied here ({modules}; its modules.json)"
        return (
            f"the model's embeddings pool by {self.kind!r} (its modules.json): last-token and mean pooling are served"
        )

    def scoring_refusal(self, model: str, relevance: bool, relevance_by: str) -> str | None:
        """Why ``model`` may not score (None: it may): it is no classifier, or (``relevance``: a pair's relevance, which
        ``relevance_by`` asks for) not one of one label."""
        if not self.classifies:
            return (
                f"{model!r} is no classifier (a *ForSequenceClassification checkpoint, or vLLM's classifier_from_token "
                "through --hf-overrides): it serves embeddings"
            )
        if relevance and len(self.labels) != 1:
            return f"{model!r} classifies into {len(self.labels)} labels: {relevance_by} takes one (a relevance)"
        return None

    def dimensions_refusal(self, dimensions: int, model: str) -> str | None:
        """Why an embedding may not be cut to ``dimensions`` (None: it may): a model that says nothing of Matryoshka,
        a number it was not trained for where it lists them, a number below 1 (vLLM's rules)."""
        if not self.matryoshka:
            return (
                f"the model {model!r} does not support Matryoshka representation (its config.json says neither "
                "is_matryoshka nor matryoshka_dimensions): cut to other dimensions, its embeddings would be poor"
            )
        if dimensions < 1:
            return f"dimensions must be at least 1, not {dimensions}"
        if self.dimensions and dimensions not in self.dimensions:
            return (
                f"the model {model!r} takes only the dimensions it was trained for: {list(self.dimensions)}, not "
                f"{dimensions}"
            )
        return None

    def embedding(
        self, state: list[float], dimensions: int | None = None, normalize: bool | None = None
    ) -> list[float]:
        """The embedding of a pooled state as the engine hands it back (the last token's hidden state, or the mean of
        every token's): a Matryoshka model's first ``dimensions`` values where asked (ValueError past its length), of
        unit length where the model's are (``normalize``: a request's own choice, vLLM's)."""
        return self.embeddings([state], dimensions, normalize)[0]

    def embeddings(
        self, states: list[list[float]], dimensions: int | None = None, normalize: bool | None = None
    ) -> list[list[float]]:
        """:meth:`embedding` of many pooled states at once (one tensor: a request of thousands of inputs)."""
        if not states:
            return []
        width = len(states[0])
        if dimensions is not None and dimensions > width:
            raise ValueError(f"dimensions {dimensions} exceed the model's {width}")
        vectors = torch.tensor(states, dtype=torch.float32)[:, :dimensions]
        unit = self.normalize if normalize is None else normalize
        return (torch.nn.functional.normalize(vectors, dim=-1) if unit else vectors).tolist()


def read_pooling(path: Path, config: dict[str, Any] | None = None) -> EmbeddingPooling:
    """The pooling of the model at ``path`` (a directory with ``modules.json``, see the module docstring; anything
    else: last-token pooling, normalized), with ``config`` its ``config.json`` as loaded (for Matryoshka)."""
    config = config or {}
    dimensions = config.get("matryoshka_dimensions") or ()
    matryoshka = bool(config.get("is_matryoshka") or dimensions)
    dimensions = tuple(int(d) for d in dimensions) if isinstance(dimensions, list) else ()
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return EmbeddingPooling(matryoshka=matryoshka, dimensions=dimensions)
    try:
        modules = json.loads(modules_file.read_text())
        kind, normalize, unapplied = "last", False, []
        for module in modules:
            module_type = str(module.get("type", "")).rsplit(".", 1)[-1]
            if module_type == "Pooling":
                pooling_config = json.loads((path / module.get("path", "") / "config.json").read_text())
                kinds = [name for key, name in _MODES.items() if pooling_config.get(key)]
                kind = "+".join(kinds) if kinds else "last"
            elif module_type == "Normalize":
                normalize = True
            elif module_type not in _NEUTRAL_MODULES:
                unapplied.append(module_type)
    except (OSError, ValueError, AttributeError, TypeError) as e:  # (a model that loads for generation all the same)
        log.warning("%s: its sentence-transformers modules do not read (%s); embeddings pool as a decoder's", path, e)
        return EmbeddingPooling(matryoshka=matryoshka, dimensions=dimensions)
    return EmbeddingPooling(kind, normalize, matryoshka, dimensions, tuple(unapplied))
