"""The engine loop reports the step it is running (how long, how big) while the step runs outside its lock, and
nothing between steps or while idle: what the cluster's watchdog reads (``cluster/stuck_step.py``)."""

from __future__ import annotations

import threading
import time

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import EngineLoop
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.hung_executor import HangTrap, HungExecutor
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel


class ManualClock:
    """The loop's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_running_step_is_reported_with_its_age_and_size_and_an_idle_loop_reports_none(
    tiny_llama: LoadedModel,
) -> None:
    config = EngineConfig(
        model=ModelConfig(max_model_len=128), cache=CacheConfig(num_kv_blocks=16), scheduler=SchedulerConfig()
    )
    core = EngineCore.from_model(tiny_llama, config)
    trap = HangTrap(lambda sched: True)  # the first step hangs
    core.executor = HungExecutor(core.executor, trap)
    clock = ManualClock()
    done = threading.Event()

    def sink(delta: RequestDelta) -> None:
        if delta.finished:
            done.set()

    loop = EngineLoop(core, sink, clock=clock)
    try:
        assert loop.step_in_flight() is None  # idle
        prompt = [(3 * j) % 300 + 3 for j in range(20)]
        loop.add("a", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        _wait_for(trap.sprung.is_set, "the first step starts")
        clock.now += 42.0
        step = loop.step_in_flight()
        assert step is not None
        assert (step.running_s, step.num_requests, step.num_tokens) == (42.0, 1, len(prompt))
        assert loop.stats()["0"].num_running == 1  # the loop's lock is free while the step hangs
        trap.release()
        assert done.wait(timeout=120), "the request finishes once the step returns"
        _wait_for(lambda: loop.step_in_flight() is None, "the loop goes idle")
        clock.now += 1e6  # however long it idles, no step is in flight
        assert loop.step_in_flight() is None
    finally:
        trap.release()
        loop.shutdown()
