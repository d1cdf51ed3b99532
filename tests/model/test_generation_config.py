"""A model's sampling defaults from its ``generation_config.json`` (served: ``tests/api/test_generation_defaults``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.model.generation_config import (
    NO_DEFAULTS,
    SamplingDefaults,
    generation_overrides,
    model_sampling_defaults,
    read_generation_defaults,
)


def test_the_defaults_a_generation_config_sets(tmp_path: Path) -> None:
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}
    (tmp_path / "generation_config.json").write_text(json.dumps({**qwen3, "max_new_tokens": 7, "min_p": "x"}))
    defaults = read_generation_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, max_tokens=7)  # (a bad value left out)
    assert defaults.given() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(tmp_path) == NO_DEFAULTS
    assert read_generation_defaults(tmp_path / "missing") == NO_DEFAULTS
    assert read_generation_defaults(tmp_path / "model.gguf") == NO_DEFAULTS


def test_defaults_from_a_directory_and_overrides(tmp_path: Path) -> None:
    """vLLM's ``--generation-config DIR`` and ``--override-generation-config``: the overrides replace or add to what
    the mode gives (``vllm``: nothing)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    assert model_sampling_defaults("smollm2-135m", str(tmp_path)) == SamplingDefaults(temperature=0.6, top_k=20)
    overrides = {"temperature": 0.2, "max_new_tokens": 9}
    both = model_sampling_defaults("smollm2-135m", str(tmp_path), overrides)
    assert both == SamplingDefaults(temperature=0.2, top_k=20, max_tokens=9)
    assert model_sampling_defaults("smollm2-135m", "vllm", overrides) == SamplingDefaults(temperature=0.2, max_tokens=9)
    with pytest.raises(ValueError, match="top_p must be a number"):
        generation_overrides({"top_p": "high"})
