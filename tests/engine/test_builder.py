"""How an engine is sized: its KV pool and, from it and the model, the longest context it admits."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from boundless.cluster.lending_plan import LendingThresholds, request_pools
from boundless.config import ConfigError
from boundless.engine.builder import size_engine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel


def test_a_context_is_capped_by_one_pool_or_with_lending_by_the_pools_it_may_span(tiny_llama: LoadedModel) -> None:
    arch, dtype = tiny_llama.arch, tiny_llama.dtype
    config = engine_config(tiny_llama.name, num_kv_blocks=8, block_size=16)
    assert size_engine(config, arch, dtype).max_model_len == 8 * 16
    # KV lending: a request's blocks beyond its own pool live on the other instances'.
    three = size_engine(config, arch, dtype, pools=3)
    assert three.max_model_len == 3 * 8 * 16 and three.num_blocks == 8  # the pool itself is unchanged
    asked = engine_config(tiny_llama.name, num_kv_blocks=8, block_size=16, max_model_len=300)
    assert size_engine(asked, arch, dtype, pools=3).max_model_len == 300
    with pytest.raises(ConfigError, match="--max-model-len: 300 tokens do not fit in the KV pool"):
        size_engine(asked, arch, dtype)
    # What the server admits with lending: its pool and what each other instance lends (60% of 8 blocks each).
    served = size_engine(config, arch, dtype, pools=request_pools(3, LendingThresholds()))
    assert served.max_model_len == int(8 * 2.2) * 16
    # The model's positions still cap it.
    roomy = engine_config(tiny_llama.name, num_kv_blocks=arch.max_position_embeddings // 16, block_size=16)
    assert size_engine(roomy, arch, dtype, pools=4).max_model_len == arch.max_position_embeddings


def test_a_windowed_model_admits_no_context_past_its_window(tiny_llama: LoadedModel) -> None:
    """Attention runs over the whole context: a sliding-window model's default context stops at its window, and an
    asked one beyond it is refused (its outputs would differ from the model's there)."""
    arch = dataclasses.replace(tiny_llama.arch, sliding_window=64)
    config = engine_config(tiny_llama.name, num_kv_blocks=32, block_size=16)
    assert size_engine(config, arch, tiny_llama.dtype).max_model_len == 64
    within = engine_config(tiny_llama.name, num_kv_blocks=32, block_size=16, max_model_len=64)
    assert size_engine(within, arch, tiny_llama.dtype).max_model_len == 64
    past = engine_config(tiny_llama.name, num_kv_blocks=32, block_size=16, max_model_len=65)
    with pytest.raises(ConfigError, match=r"--max-model-len: 65 tokens exceed the model's sliding window \(64\)"):
        size_engine(past, arch, tiny_llama.dtype)


def test_a_context_past_the_models_is_refused_unless_allowed(tiny_llama: LoadedModel) -> None:
    """As vLLM: an asked context longer than the model's positions stops start-up, naming the flag that allows it."""
    arch, dtype = tiny_llama.arch, tiny_llama.dtype
    blocks = 2 * arch.context_length // 16
    past = engine_config(tiny_llama.name, num_kv_blocks=blocks, max_model_len=arch.context_length + 1)
    with pytest.raises(ConfigError, match=r"exceed the model's context .* --allow-long-max-model-len"):
        size_engine(past, arch, dtype)
    allowed = engine_config(
        tiny_llama.name, num_kv_blocks=blocks, max_model_len=arch.context_length + 1, allow_long_max_model_len=True
    )
    assert size_engine(allowed, arch, dtype).max_model_len == arch.context_length + 1
    at = engine_config(tiny_llama.name, num_kv_blocks=blocks, max_model_len=arch.context_length)
    assert size_engine(at, arch, dtype).max_model_len == arch.context_length


def test_async_scheduling_without_graphs_says_it_does_nothing(
    tiny_llama: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """``--async-scheduling`` overlaps steps run on CUDA graphs; an engine without them (the CPU, PyTorch's backend,
    ``--enforce-eager``) says at start-up that the flag changes nothing, and runs as without it."""
    config = engine_config(tiny_llama.name, num_kv_blocks=8, async_scheduling=True)
    with caplog.at_level(logging.WARNING, logger="boundless.engine.builder"):
        core = EngineCore.from_model(tiny_llama, config)
    assert core.executor.runner.graphs is None
    assert "--async-scheduling has no effect here" in caplog.text and "TorchPagedAttention" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="boundless.engine.builder"):
        EngineCore.from_model(tiny_llama, engine_config(tiny_llama.name, num_kv_blocks=8))
    assert "--async-scheduling" not in caplog.text
