"""A step whose KV transfer fails fails the requests it concerns; the engine goes on serving the others. Step hooks
(KV lending's) run between steps and may handle a failed step instead."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import EngineLoop
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import HOST
from boundless.model.loader import LoadedModel

PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


class FailingHostTier(HostKVTier):
    """Host memory whose first write raises, as a copy to the host that fails mid-step (the test's fault)."""

    def __init__(self, device: PagedKVCache, num_blocks: int) -> None:
        super().__init__(device, num_blocks)
        self.failures_left = 1

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("injected fault: the copy to host memory failed")
        super().write_blocks(block_ids, blocks)


def _core(loaded: LoadedModel, failing: bool) -> EngineCore:
    # Eight 16-token blocks: two 40-token prompts fit, and growing to 64 tokens makes the later one give way.
    config = EngineConfig(
        model=ModelConfig(max_model_len=128),
        cache=CacheConfig(num_kv_blocks=8, swap_space_gb=0.001),
        scheduler=SchedulerConfig(policy="fcfs"),
    )
    core = EngineCore.from_model(loaded, config)
    if failing:
        core.executor.tiers[HOST] = FailingHostTier(core.executor.runner.kv_cache, core.layout.num_host_blocks)
    return core


class Outcomes:
    """An engine loop's sink: the tokens and the finish reason of each request it was told to expect."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str | None] = {}
        self.done = threading.Event()

    def expect(self, request_ids: list[str]) -> None:
        self.tokens = {rid: [] for rid in request_ids}
        self.reasons = {}
        self.done.clear()

    def __call__(self, delta: RequestDelta) -> None:
        self.tokens[delta.request_id].extend(delta.new_token_ids)
        if delta.finished:
            self.reasons[delta.request_id] = delta.finish_reason
            if len(self.reasons) == len(self.tokens):
                self.done.set()


def _serve(loop: EngineLoop, outcomes: Outcomes, prompts: dict[str, list[int]]) -> Outcomes:
    outcomes.expect(list(prompts))
    for rid, prompt in prompts.items():
        loop.add(rid, prompt, PARAMS)
    assert outcomes.done.wait(timeout=300), "every request ends"
    return outcomes


def test_a_failed_swap_out_fails_the_step_and_its_victim_and_the_rest_is_served(tiny_llama: LoadedModel) -> None:
    prompts = {str(i): [(7 * i + j) % 300 + 3 for j in range(40)] for i in range(4)}
    outcomes = Outcomes()
    clean = EngineLoop(_core(tiny_llama, failing=False), outcomes)
    try:
        expected = dict(_serve(clean, outcomes, prompts).tokens)
        assert clean.core.stats().num_swapped_out > 0, "the workload swaps"
    finally:
        clean.shutdown()
    loop = EngineLoop(_core(tiny_llama, failing=True), outcomes)
    try:
        _serve(loop, outcomes, prompts)
        failed = {rid for rid, reason in outcomes.reasons.items() if reason == "error"}
        # The step that swapped "1" out to make room for "0" raised: "0" was in it, "1" lost its KV in it.
        assert failed == {"0", "1"}
        for rid in prompts.keys() - failed:
            assert outcomes.tokens[rid] == expected[rid], f"request {rid} is served as if nothing failed"
        _serve(loop, outcomes, {f"again-{rid}": prompts[rid] for rid in failed})
        assert outcomes.tokens == {f"again-{rid}": expected[rid] for rid in failed}
        assert loop.is_alive()
    finally:
        loop.shutdown()


class RerunOnce:
    """Step hooks (KV lending's shape): the engine's next step raises a fault they handle by running its chunks
    again, as a lending agent does when a creditor does not answer."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.between = 0
        self.handled: list[Exception] = []
        execute = core.execute

        def failing_once(sched):
            if not self.handled:
                raise ConnectionError("injected fault: a creditor did not answer")
            return execute(sched)

        core.execute = failing_once

    def between_steps(self) -> list:
        self.between += 1
        return []

    def step_failed(self, error: Exception, sched) -> bool:
        if not isinstance(error, ConnectionError):
            return False
        self.handled.append(error)
        self.core.scheduler.step_failed(sched)
        return True


def test_step_hooks_run_between_steps_and_a_step_they_handle_fails_nothing(tiny_llama: LoadedModel) -> None:
    prompts = {str(i): [(5 * i + j) % 300 + 3 for j in range(20)] for i in range(2)}
    outcomes = Outcomes()
    clean = EngineLoop(_core(tiny_llama, failing=False), outcomes)
    try:
        expected = dict(_serve(clean, outcomes, prompts).tokens)
    finally:
        clean.shutdown()
    core = _core(tiny_llama, failing=False)
    hooks = RerunOnce(core)
    loop = EngineLoop(core, outcomes, hooks=hooks)
    try:
        _serve(loop, outcomes, prompts)
        assert len(hooks.handled) == 1 and hooks.between > PARAMS.max_tokens
        assert set(outcomes.reasons.values()) == {"length"}  # the failed step's requests ran again
        assert outcomes.tokens == expected
    finally:
        loop.shutdown()
