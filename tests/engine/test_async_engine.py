"""The engine loop stopped by an error outside a step (in deciding a step or in taking its result, where the loop's
guard of the forward pass does not reach): its requests end with an error instead of waiting for ever, it says it is
dead, and it takes no more."""

from __future__ import annotations

import asyncio

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import AsyncEngine, EngineDeadError
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel

PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _core_failing_after(loaded: LoadedModel, steps: int) -> EngineCore:
    """A real engine whose taking of a step's result raises after ``steps`` steps (the test's fault: a bug there)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=128), cache=CacheConfig(num_kv_blocks=16), scheduler=SchedulerConfig()
    )
    core = EngineCore.from_model(loaded, config)
    finish_step = core.finish_step
    taken = [0]

    def failing(sched, result):
        taken[0] += 1
        if taken[0] > steps:
            raise KeyError("injected fault: a bug in taking a step's result")
        return finish_step(sched, result)

    core.finish_step = failing  # type: ignore[method-assign]
    return core


def test_a_loop_stopped_by_an_error_outside_a_step_ends_its_requests_with_an_error(tiny_llama: LoadedModel) -> None:
    # Before, the loop's thread died with the error: /health said unavailable, but every request in flight waited for
    # ever (its stream was never ended), and an instance of a cluster went on answering heartbeats.
    engine = AsyncEngine(_core_failing_after(tiny_llama, steps=3))

    async def run() -> list[RequestDelta]:
        streams = [engine.submit(str(i), [(5 * i + j) % 300 + 3 for j in range(20)], PARAMS) for i in range(2)]

        async def drain(stream) -> RequestDelta:
            last = None
            async for delta in stream:
                last = delta
            return last

        return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=120)

    try:
        ends = asyncio.run(run())
        assert [d.finish_reason for d in ends] == ["error", "error"]
        assert all("the engine stopped" in d.stop_reason and "KeyError" in d.stop_reason for d in ends)
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError, match="the engine stopped"):
            engine.add("later", [3, 4, 5], PARAMS)
    finally:
        engine.shutdown()
