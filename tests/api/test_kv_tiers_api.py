"""KV tiers seen from the HTTP edge: ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens served
from any tier, and ``/metrics`` shows each tier's hits and traffic and the disk store's loads.

A real server on 127.0.0.1 and the official ``openai`` client; the engine's disk store is conftest's
``DictStore`` until the persistent store (``kv/disk_store.py``) lands.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from boundless.api.launch import ServerThread, start_in_thread
from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.model.loader import LoadedModel

NAME = "tiny"


@pytest.fixture
def served(tiny_llama: LoadedModel, dict_store: type, tmp_path: Path) -> Iterator[tuple[AsyncEngine, ServerThread]]:
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(num_kv_blocks=16, kv_disk_path=str(tmp_path), kv_write_policy="through"),
    )
    layout = size_engine(config, tiny_llama.arch, tiny_llama.dtype)
    executor = build_model_executor(tiny_llama, config, layout, store=dict_store())
    core = EngineCore(config, layout, ModelIdentity.of(tiny_llama, layout), tiny_llama.tokenizer, executor)
    engine = AsyncEngine(core)
    server = start_in_thread(engine, NAME)
    yield engine, server
    server.stop()
    engine.shutdown()


def _metric(text: str, name: str, tier: str | None = None) -> float:
    labels = '{instance="0"' + (f',tier="{tier}"' if tier else "") + "}"
    match = re.search(re.escape(name + labels) + r" (\S+)", text)
    assert match is not None, f"{name}{labels} missing"
    return float(match.group(1))


def test_cached_tokens_count_prefixes_from_host_memory_and_from_disk(
    served: tuple[AsyncEngine, ServerThread],
) -> None:
    engine, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = [(11 * j) % 300 + 3 for j in range(100)]  # six full blocks and four tokens

    def complete(tokens: list[int]) -> openai.types.Completion:
        return client.completions.create(model=NAME, prompt=tokens, max_tokens=4, temperature=0)

    cold = complete(prompt)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    for i in range(3):  # other conversations push the prompt's blocks out of the 16-block device pool
        complete([(7 * j + i) % 300 + 3 for j in range(100)])
    from_host = complete(prompt)
    assert from_host.usage.prompt_tokens_details.cached_tokens == 96
    engine.core.executor.kv_io.flush()  # write-through has put the blocks in the store
    with engine.lock:
        engine.core.reset_prefix_cache()  # nothing left in memory
    from_disk = complete(prompt)
    assert from_disk.usage.prompt_tokens_details.cached_tokens == 96
    assert from_disk.choices[0].text == from_host.choices[0].text == cold.choices[0].text
    text = httpx.get(server.url + "/metrics").text
    assert _metric(text, "boundless_kv_tier_hit_tokens_total", "host") >= 96
    assert _metric(text, "boundless_kv_tier_hit_tokens_total", "disk") == 96
    assert _metric(text, "boundless_kv_tier_evictions_total", "device") > 0
    assert _metric(text, "boundless_kv_tier_read_bytes_total", "disk") > 0
    assert _metric(text, "boundless_kv_disk_loads_total") >= 1
    assert _metric(text, "boundless_kv_disk_written_blocks_total") > 0
    assert 'boundless_kv_disk_store{instance="0",stat="blocks"}' in text
