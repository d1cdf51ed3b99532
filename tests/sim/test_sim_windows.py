"""The simulator sizes a sliding-window model's engines as the cluster does: a plain instance gives blocks back past
the window (its whole context), a prefill/decode role's does not (its context stays within the pool), and every
agent program runs to its end."""

from __future__ import annotations

from pathlib import Path

from boundless.bench.workloads import WorkloadShape, agent_sessions
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import load_profile
from boundless.sim.simulator import Simulator


def test_prefill_and_decode_engines_of_a_windowed_model_keep_their_context_within_the_pool(
    model_dirs: dict[str, Path],
) -> None:
    model = SimulatedModel.read(ModelConfig(model=str(model_dirs["tiny-mistral-window"])))
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=30, kv_host_gb=0.001),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=64),
    )
    programs = agent_sessions(2, 0.0, 1, WorkloadShape(scale=0.05, call_scale=0.25, tool_wait_s=0.1))
    roles = Simulator(config, model, cluster=ClusterConfig(prefill_instances=1, decode_instances=1, kv_path="basic"),
                      profile=load_profile("h100"))  # fmt: skip
    assert roles.max_model_len == 30 * 16 and roles.instances["p0"].core.kv.window is None
    results = roles.run(programs)
    assert all(r.finished and not r.failed_calls for r in results)
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)
    plain = Simulator(config, model, profile=load_profile("h100"))
    assert plain.max_model_len == model.arch.context_length and plain.core.kv.window == 12
