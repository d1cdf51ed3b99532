"""An instance's side of KV lending in its engine loop (``cluster/lending_instance.py``), without Ray: a real engine
in a real ``EngineLoop`` with ``InstanceLending`` as its step hooks, over a shared-memory transport."""

from __future__ import annotations

import threading

from boundless.cluster.lending_cluster import OrderGrant
from boundless.cluster.lending_instance import InstanceLending, LendingSetup
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import EngineLoop
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

BLOCK = 16
CHUNK = 32
POOL = 40


def _engine(loaded: LoadedModel) -> EngineCore:
    """A pool of 40 blocks; with lending a request may hold two pools (its ``max_model_len``)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=2 * POOL * BLOCK),
        cache=CacheConfig(num_kv_blocks=POOL, enable_prefix_caching=True),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=CHUNK),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype, pools=2)
    executor = build_model_executor(loaded, config, layout)
    return EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)


def test_a_heartbeat_answers_while_a_long_step_runs_and_reports_what_the_step_will_leave(load, tmp_path) -> None:
    """The loop holds its lock only between steps, so the heartbeat does not wait for a step (a step longer than the
    heartbeat timeout must not make a busy instance look dead). Taken mid-step, its report sees the request as the
    step will leave it: the chunk that fills the pool leaves the next one 2 blocks short, so it waits for them (the
    planner lends for it). Before, the mid-step report counted the chunk's blocks but not its tokens: no stall."""
    loaded = load("tiny-llama")
    core = _engine(loaded)
    net = ShmTransport(tmp_path / "shm", "i0", timeout_s=10)
    setup = LendingSetup(ClusterConfig(instances=2, kv_lending="on"), str(tmp_path), 0, 2)
    lending = InstanceLending(core, net, net.address, setup, threading.Lock())
    entered, answered = threading.Event(), threading.Event()
    answered_during_step: list[bool] = []
    execute = core.execute

    def gated(sched):
        if any(c.start_pos + len(c.token_ids) == POOL * BLOCK for c in sched.chunks):  # the chunk that fills the pool
            entered.set()
            answered_during_step.append(answered.wait(timeout=30))
        return execute(sched)

    core.execute = gated  # type: ignore[method-assign]
    loop = EngineLoop(core, lambda delta: None, hooks=lending)
    lending.lock = loop.lock  # the agent's methods run under the loop's lock, as in an instance
    try:
        prompt = [(5 * j) % 300 + 3 for j in range(POOL * BLOCK + 3 * CHUNK)]
        loop.add("long", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        lending.order(OrderGrant("i0", "long"))  # longer than the pool: it starts on the gManager's grant
        loop.wake()
        assert entered.wait(timeout=60)
        beat = lending.heartbeat()
        answered.set()
        assert beat.instance.waiting_blocks == (CHUNK // BLOCK,) and beat.instance.batch_size == 0
        (request,) = beat.requests
        assert request.num_tokens == POOL * BLOCK and request.local_blocks == POOL
    finally:
        answered.set()
        loop.shutdown()
        lending.close()
        net.close()
    assert answered_during_step == [True]
