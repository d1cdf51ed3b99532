"""A model's own default sampling parameters, from its ``generation_config.json`` (vLLM's ``--generation-config
auto``, its default; or another directory's, and vLLM's ``--override-generation-config``).

Model makers ship the sampling their models are tuned for: Qwen3's thinking models, for example, say temperature
0.6, top_p 0.95 and top_k 20, and greedy decoding makes them repeat themselves. A request that leaves a parameter
out gets the model's value, else the API's own default (temperature 1, no top-k...). A GGUF file, or a directory
without the file, has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
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
    if not isinstance(config, dict):
        return NO_DEFAULTS
    values: dict[str, Any] = {_KEYS[key]: _value(key, value) for key, value in config.items() if _valid(key, value)}
    return SamplingDefaults(**values)


# The fields whose values are whole numbers.
_WHOLE = ("top_k", "max_tokens")


def _valid(key: str, value: Any) -> bool:
    """Whether ``key`` is one of the sampling keys read, with a value of its type."""
    if key not in _KEYS:
        return False
    return not isinstance(value, bool) and isinstance(value, int if _KEYS[key] in _WHOLE else (int, float))


def _value(key: str, value: int | float) -> int | float:
    return int(value) if _KEYS[key] in _WHOLE else float(value)


def generation_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--override-generation-config`` (a JSON object of ``generation_config.json``'s keys), as
    :class:`SamplingDefaults` fields; a key not read here, or a value not of its type, raises ValueError naming it (the
    model's own file is trusted less: its bad values are left out)."""
    unknown = sorted(set(overrides) - set(_KEYS))
    if unknown:
        raise ValueError(f"keys {unknown} are not sampling parameters read here; known: {sorted(_KEYS)}")
    bad = sorted(key for key, value in overrides.items() if not _valid(key, value))
    if bad:
        raise ValueError(f"{bad[0]} must be a number (top_k and max_new_tokens whole), not {overrides[bad[0]]!r}")
    return {_KEYS[key]: _value(key, value) for key, value in overrides.items()}


def model_sampling_defaults(
    model: str, mode: str = "auto", overrides: dict[str, Any] | None = None
) -> SamplingDefaults:
    """The defaults a server of ``model`` (a name ``load_model`` takes) applies, as vLLM's ``--generation-config``
    gives them: with ``mode`` ``auto`` its ``generation_config.json``'s, with ``vllm`` none, else (a directory) that
    directory's ``generation_config.json``'s; ``overrides`` (``--override-generation-config``) replace or add to
    them."""
    from boundless.model.loader import resolve_model_path

    if mode == "auto":
        defaults = read_generation_defaults(resolve_model_path(model))
    elif mode == "vllm":
        defaults = NO_DEFAULTS
    else:
        defaults = read_generation_defaults(Path(mode).expanduser())
    return replace(defaults, **generation_overrides(overrides or {}))
