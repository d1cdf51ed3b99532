"""An engine instance (the body of a Ray actor, here in this process over the tiny model): one whose engine loop
stopped by an error outside a step says so at its heartbeat, so that the front end loses it and fails its calls over;
its refusal of a call reaches the front end's client whole."""

from __future__ import annotations

import pickle
import time

import pytest

from boundless.cluster.client import failure_error
from boundless.cluster.dispatcher import Fail
from boundless.cluster.instance import EngineInstance
from boundless.engine.async_engine import EngineDeadError
from boundless.engine.errors import CONTEXT_LENGTH_EXCEEDED, ContextOverflow, InvalidRequestError
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


def test_an_instances_refusal_reaches_the_front_end_with_its_code_and_overflow(tiny_llama: LoadedModel) -> None:
    # Before, the answer carried the message and the field only, and the front end rebuilt the error as
    # ``invalid_value``: an agent reading ``context_length_exceeded`` to compact its history saw another code.
    inst = EngineInstance(
        "r1", engine_config(tiny_llama.name, max_model_len=32, kv_cache_gb=0.01), 16, loaded=tiny_llama
    )
    try:
        answer = inst.add("long", list(range(3, 33)), SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        inst.shutdown()
    assert answer.status == "invalid"
    answer = pickle.loads(pickle.dumps(answer))  # as Ray carries it from the actor
    error = failure_error(Fail("long", "invalid", answer.message, answer.refusal))
    assert isinstance(error, InvalidRequestError)
    assert (error.param, error.code) == ("max_tokens", CONTEXT_LENGTH_EXCEEDED)
    assert error.overflow == ContextOverflow(prompt_tokens=30, max_tokens=8, max_model_len=32)
