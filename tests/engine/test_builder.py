"""How an engine is sized: its KV pool and, from it and the model, the longest context it admits."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

from boundless.cluster.lending_plan import LendingThresholds, request_pools
from boundless.config import ConfigError
from boundless.engine.builder import DeviceMemory, check_host_memory, physical_memory_bytes, size_engine
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


def test_a_windowed_model_serves_its_whole_context(tiny_llama: LoadedModel) -> None:
    """Attention runs within the window (``attention/backend.py``): a sliding-window model's context is the model's,
    not its window's (it was capped at the window, and a longer one refused)."""
    arch = dataclasses.replace(tiny_llama.arch, sliding_window=64)
    blocks = arch.context_length // 16
    config = engine_config(tiny_llama.name, num_kv_blocks=blocks, block_size=16)
    assert size_engine(config, arch, tiny_llama.dtype).max_model_len == arch.context_length
    past = engine_config(tiny_llama.name, num_kv_blocks=blocks, block_size=16, max_model_len=65)
    assert size_engine(past, arch, tiny_llama.dtype).max_model_len == 65
    # A pool without room for a window, a step's tokens and a block: the pool caps the context, and says what frees it.
    small = engine_config(tiny_llama.name, num_kv_blocks=8, block_size=16, max_model_len=200)
    with pytest.raises(ConfigError, match=r"or lower --max-num-batched-tokens: with the model's sliding window of 64"):
        size_engine(small, arch, tiny_llama.dtype)
    # A pool of 512 tokens holds a window (64), a step's 128 tokens and a block: the whole context; not on an engine
    # whose requests' blocks are read whole or moved by index (a prefill/decode role's, lending's).
    roomy = engine_config(tiny_llama.name, num_kv_blocks=32, block_size=16, max_num_batched_tokens=128)
    assert size_engine(roomy, arch, tiny_llama.dtype).max_model_len == arch.context_length
    assert size_engine(roomy, arch, tiny_llama.dtype, release_windows=False).max_model_len == 512


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


def test_gpu_memory_utilization_gives_the_pool_that_fraction_less_what_is_in_use(tiny_llama: LoadedModel) -> None:
    """vLLM's flag, sized as SGLang's static fraction: of 0.5 of 80 GiB with 24 GiB in use (the weights, others), the
    pool takes 16 GiB; the context is capped by it as by any pool. Not on a device that is not CUDA, nor when the
    fraction leaves no room (each said at start-up, naming the flag)."""
    arch, dtype = tiny_llama.arch, tiny_llama.dtype
    gib = 1 << 30
    config = engine_config(tiny_llama.name, gpu_memory_utilization=0.5, block_size=16)
    per_block = size_engine(config, arch, dtype, memory=DeviceMemory(free=56 * gib, total=80 * gib)).bytes_per_block
    layout = size_engine(config, arch, dtype, memory=DeviceMemory(free=56 * gib, total=80 * gib))
    assert layout.num_blocks == 16 * gib // per_block
    small = size_engine(config, arch, dtype, memory=DeviceMemory(free=40 * gib + 8 * per_block, total=80 * gib))
    assert small.num_blocks == 8 and small.max_model_len == 8 * 16
    # --num-kv-blocks still wins; --kv-cache-gb is what the flag replaces.
    fixed = engine_config(tiny_llama.name, gpu_memory_utilization=0.5, num_kv_blocks=3)
    assert size_engine(fixed, arch, dtype, memory=DeviceMemory(free=56 * gib, total=80 * gib)).num_blocks == 3
    with pytest.raises(ConfigError, match="--gpu-memory-utilization sizes the KV pool on a CUDA device"):
        size_engine(config, arch, dtype)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization: 0.5 .* 60.0 GiB is in use"):
        size_engine(config, arch, dtype, memory=DeviceMemory(free=20 * gib, total=80 * gib))
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match=r"--gpu-memory-utilization: must be in \(0, 1\]"):
            engine_config(tiny_llama.name, gpu_memory_utilization=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's memory")
def test_gpu_memory_utilization_on_cuda(tiny_llama: LoadedModel) -> None:
    """On a GPU the engine reads the device's memory as it is built: its pool is the fraction less what is in use."""
    from boundless.model.loader import load_model

    loaded = load_model(tiny_llama.name, device="cuda")
    free, total = torch.cuda.mem_get_info()
    # A fraction that leaves the pool ~1 GiB, whatever earlier tests in the process hold.
    fraction = min(1.0, (total - free + (1 << 30)) / total)
    core = EngineCore.from_model(loaded, engine_config(tiny_llama.name, gpu_memory_utilization=fraction))
    expected = (int(fraction * total) - (total - free)) // core.layout.bytes_per_block
    assert expected > 0 and abs(core.layout.num_blocks - expected) <= expected // 100 + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bound is the CPU's (CUDA runs the compiled kernel)")
def test_flex_attention_off_cuda_refuses_a_pool_its_eager_reference_cannot_score(tiny_llama: LoadedModel) -> None:
    """``--attention-backend flex`` on the CPU scores a step's tokens against the whole pool (PyTorch's eager
    reference): a pool that would take more than a GiB of scores is refused with what to change, not run out of
    memory; one that fits runs."""
    big = engine_config(tiny_llama.name, num_kv_blocks=2**16, attention_backend="flex")
    with pytest.raises(ConfigError, match=r"--attention-backend flex on cpu .* shrink --num-kv-blocks"):
        EngineCore.from_model(tiny_llama, big)
    small = engine_config(tiny_llama.name, num_kv_blocks=32, max_model_len=256, attention_backend="flex")
    assert type(EngineCore.from_model(tiny_llama, small).executor.runner.attention).__name__ == "FlexPagedAttention"


def test_flash_prefill_is_refused_where_flashattention_cannot_take_it(tiny_llama: LoadedModel) -> None:
    """``--flash-prefill`` goes with the Triton backend, on CUDA, in bf16 or fp16: elsewhere it is refused at start-up
    with the reason (not a step that fails later)."""
    with pytest.raises(ConfigError, match="--flash-prefill goes with the triton attention backend, not torch"):
        EngineCore.from_model(tiny_llama, engine_config(tiny_llama.name, attention_backend="torch", flash_prefill=True))
    if tiny_llama.device.type != "cuda" or tiny_llama.model.embed_tokens.weight.dtype == torch.float32:
        triton = engine_config(tiny_llama.name, attention_backend="triton", flash_prefill=True, num_kv_blocks=32)
        with pytest.raises(ConfigError, match="FlashAttention runs on CUDA in bfloat16 or float16"):
            EngineCore.from_model(tiny_llama, triton)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"kv_host_gb": 4.0}, "--kv-host-gb: 4.0 GiB of KV in host memory, beside the KV pool's 0.0 GiB, is more"),
        ({"kv_host_gb": None, "swap_space_gb": 4.0}, "--swap-space-gb: 4.0 GiB of KV in host memory"),
        ({"num_kv_blocks": 300_000}, "--num-kv-blocks: a KV pool of 2.3 GiB is more than this machine's memory (2.0"),
        ({"kv_cache_gb": 3.0}, "--kv-cache-gb: a KV pool of 3.0 GiB is more than this machine's memory"),
        # Each of a split model's ranks holds pools as large, on this machine.
        ({"kv_cache_gb": 0.8, "tensor_parallel_size": 3}, "--kv-cache-gb: a KV pool of 2.4 GiB is more"),
        ({"kv_host_gb": 0.5, "tensor_parallel_size": 5}, "--kv-host-gb: 2.5 GiB of KV in host memory"),
    ],
)
def test_kv_memory_past_the_machines_is_refused_naming_its_flag(
    tiny_llama: LoadedModel, flags: dict[str, float | None], said: str
) -> None:
    """``--kv-host-gb 100000`` failed with the allocator's traceback once the model had loaded (and a pool under the
    overcommit limit was reserved, to be killed when filled). Checked against a 2 GiB machine."""
    config = engine_config(tiny_llama.name, **{"kv_cache_gb": 0.001, "kv_host_gb": 0.0, **flags})  # type: ignore[arg-type]
    layout = size_engine(config, tiny_llama.arch, tiny_llama.dtype)
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_host_memory(config, layout, torch.device("cpu"), memory=2 << 30)
    check_host_memory(config, layout, torch.device("cpu"), memory=None)  # (a system that does not say: no check)


def test_an_engine_with_more_host_kv_than_the_machine_has_does_not_start(tiny_llama: LoadedModel) -> None:
    """Through the engine's start: refused before any of it is allocated."""
    memory = physical_memory_bytes()
    assert memory is not None
    config = engine_config(tiny_llama.name, kv_cache_gb=0.01, kv_host_gb=4 * memory / (1 << 30))
    with pytest.raises(ConfigError, match=r"^--kv-host-gb: .* is more than this machine's memory"):
        EngineCore.from_model(tiny_llama, config)


def test_a_kv_disk_path_that_cannot_be_a_directory_stops_the_engine(tiny_llama: LoadedModel, tmp_path: Path) -> None:
    """A file (or a path under one) given as ``--kv-disk-path`` started the engine with its store's writes off, one
    warning among the start-up lines, and never stored a block; an unwritable directory is still the store's to live
    with (it reads on)."""
    file = tmp_path / "store"
    file.write_text("not a directory")
    for path in (file, file / "under"):
        config = engine_config(tiny_llama.name, kv_cache_gb=0.01, kv_disk_path=str(path))
        with pytest.raises(ConfigError, match=f"^--kv-disk-path: {re.escape(str(path))} is no directory"):
            EngineCore.from_model(tiny_llama, config)
