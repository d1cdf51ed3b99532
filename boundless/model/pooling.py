"""How a model's hidden states make an embedding of a text (``/v1/embeddings``, ``LLM.embed``), as sentence-transformers
and vLLM read it from the model's directory.

A sentence-transformers model directory says so in ``modules.json``: a ``Pooling`` module (its ``config.json`` names
the pooling: ``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``) and, where the
embeddings are unit vectors, a ``Normalize`` module. Decoder embedding models (Qwen3-Embedding, gte-Qwen2,
e5-mistral) pool the last token and normalize; a directory without ``modules.json`` (any causal LM, a GGUF file) is
read the same way, as vLLM's default for them. ``config.json``'s ``is_matryoshka`` or ``matryoshka_dimensions`` say
that a prefix of the embedding is an embedding too (the API's ``dimensions``).

The engine computes the last token's hidden state (after the final norm) as it computes the row it samples from: only
last-token pooling is served; a model whose directory names another is refused when asked for an embedding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
class EmbeddingPooling:
    """How the model's hidden states pool into an embedding: ``kind`` (``last`` is served), unit length or not, and
    whether a prefix of it is an embedding too (Matryoshka representation learning)."""

    kind: str = "last"
    normalize: bool = True
    matryoshka: bool = False

    @property
    def served(self) -> bool:
        return self.kind == "last"

    def pool(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Embeddings [rows, hidden] in fp32 of the last tokens' hidden states [rows, hidden]."""
        embeddings = last_hidden.float()
        return torch.nn.functional.normalize(embeddings, dim=-1) if self.normalize else embeddings


def read_pooling(path: Path, config: dict[str, Any] | None = None) -> EmbeddingPooling:
    """The pooling of the model at ``path`` (a directory with ``modules.json``, see the module docstring; anything
    else: last-token pooling, normalized), with ``config`` its ``config.json`` as loaded (for Matryoshka)."""
    config = config or {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return EmbeddingPooling(matryoshka=matryoshka)
    modules = json.loads(modules_file.read_text())
    kind, normalize = "last", False
    for module in modules:
        module_type = str(module.get("type", ""))
        if module_type.endswith("Pooling"):
            pooling_config = json.loads((path / module.get("path", "") / "config.json").read_text())
            kinds = [name for key, name in _MODES.items() if pooling_config.get(key)]
            kind = "+".join(kinds) if kinds else "last"
        elif module_type.endswith("Normalize"):
            normalize = True
    return EmbeddingPooling(kind, normalize, matryoshka)
