"""An engine instance (the body of a Ray actor, here in this process over the tiny model) whose engine loop stopped
by an error outside a step says so at its heartbeat, so that the front end loses it and fails its calls over."""

from __future__ import annotations

import time

import pytest

from boundless.cluster.instance import EngineInstance
from boundless.engine.async_engine import EngineDeadError
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel


def test_an_instance_whose_engine_loop_stopped_fails_its_heartbeat(tiny_llama: LoadedModel) -> None:
    # Before, the loop's thread died and the actor went on answering heartbeats with its last stats: the front end
    # never lost it, and its calls waited for ever.
    inst = EngineInstance(
        "d7", engine_config(tiny_llama.name, max_model_len=128, kv_cache_gb=0.01), 16, loaded=tiny_llama
    )
    try:
        inst.heartbeat()  # alive
        core = inst.loop.core
        finish_step = core.finish_step

        def failing(sched, result):
            raise KeyError("injected fault: a bug in taking a step's result")

        core.finish_step = failing  # type: ignore[method-assign]
        assert inst.add("r", [3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=8)).status == "ok"
        deadline = time.monotonic() + 120
        while inst.loop.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EngineDeadError, match=r"instance d7: the engine stopped after an error \(KeyError"):
            inst.heartbeat()
        core.finish_step = finish_step  # type: ignore[method-assign]
    finally:
        inst.shutdown()
