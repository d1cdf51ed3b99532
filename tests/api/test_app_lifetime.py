"""A stopped server lets go of its engine: benchmarks and validate start many servers in one process."""

from __future__ import annotations

import gc
import time
import weakref

import openai

from boundless.api.launch import start_in_thread
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.sim.cost import CostModel
from boundless.sim.engine import SimulatedModel, simulated_engine


def _serve_once(model: SimulatedModel) -> weakref.ref:
    config = EngineConfig(ModelConfig(max_model_len=128), CacheConfig(num_kv_blocks=32), SchedulerConfig())
    core = simulated_engine(config, model, CostModel(), time.monotonic)
    engine = AsyncEngine(core)
    server = start_in_thread(engine, "m")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        done = client.completions.create(model="m", prompt="hello", max_tokens=3)
        assert done.usage.completion_tokens == 3
        assert client.models.list().data[0].id == "m"
    finally:
        server.stop()
        engine.shutdown()
    return weakref.ref(core)


def test_a_stopped_server_frees_its_engine() -> None:
    model = SimulatedModel.read(ModelConfig())
    cores = [_serve_once(model) for _ in range(2)]
    gc.collect()
    # Routes made per app as closures over the engine were kept by FastAPI's process-wide caches, and with them
    # every engine (and its KV cache) the process had served.
    assert [ref() for ref in cores] == [None, None]
