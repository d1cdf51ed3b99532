"""Shared fixtures: models loaded once per session (loading is the slow part of most tests)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (set before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the shared models load: BOUNDLESS_TEST_DEVICE=cuda runs the reference tests on a GPU.
TEST_DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")

from boundless.model.loader import LoadedModel, load_model  # noqa: E402 (after TRITON_INTERPRET)
from boundless.model.random_model import TinySpec, write_random_model  # noqa: E402

torch.set_num_threads(max(1, torch.get_num_threads()))

TINY_SPECS = {
    # GQA and llama3 rope scaling (factor 8 over an original 64 positions, so the scaling bites).
    "tiny-llama": TinySpec(
        kind="llama",
        num_heads=4,
        num_kv_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v biases, untied embeddings, no GQA.
    "tiny-qwen2": TinySpec(kind="qwen2", num_heads=4, num_kv_heads=4, seed=1),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_random_model(root / name, spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def load(model_dirs: dict[str, Path]) -> Callable[[str], LoadedModel]:
    """Load a model once per session by name: ``smollm2-135m`` or one of :data:`TINY_SPECS`."""
    loaded: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in loaded:
            loaded[name] = load_model(name if name == "smollm2-135m" else str(model_dirs[name]), device=TEST_DEVICE)
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def smollm2(load: Callable[[str], LoadedModel]) -> LoadedModel:
    return load("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama(load: Callable[[str], LoadedModel]) -> LoadedModel:
    return load("tiny-llama")
