"""A model's own default sampling parameters, from its ``generation_config.json`` (vLLM's ``--generation-config
auto``, its default).

Model makers ship the sampling their models are tuned for: Qwen3's thinking models, for example, say temperature
0.6, top_p 0.95 and top_k 20, and greedy decoding makes them repeat themselves. A request that leaves a parameter
out gets the model's value, else the API's own default (temperature 1, no top-k...). A GGUF file, or a directory
without the file, has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# generation_config.json's keys that vLLM reads -> this module's field names.
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling parameters a request that omits them gets; None where the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def given(self) -> dict[str, Any]:
        """The parameters the model sets."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


NO_DEFAULTS = SamplingDefaults()


def read_generation_defaults(model_path: Path) -> SamplingDefaults:
    """The defaults in ``model_path``'s ``generation_config.json`` (a model directory; a GGUF file has none). Values
    of the wrong type are left out rather than trusted."""
    file = model_path / "generation_config.json" if model_path.is_dir() else None
    if file is None or not file.is_file():
        return NO_DEFAULTS
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return NO_DEFAULTS
    values: dict[str, Any] = {}
    for key, name in _KEYS.items():
        value = config.get(key) if isinstance(config, dict) else None
        integral = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            continue
        values[name] = int(value) if integral else float(value)
    return SamplingDefaults(**values)


def model_sampling_defaults(model: str, mode: str = "auto") -> SamplingDefaults:
    """The defaults a server of ``model`` (a name ``load_model`` takes) applies: its ``generation_config.json``'s
    with ``mode`` ``auto``, none with ``vllm`` (``--generation-config``)."""
    from boundless.model.loader import resolve_model_path

    return read_generation_defaults(resolve_model_path(model)) if mode == "auto" else NO_DEFAULTS
