"""Engines with KV lending in one process over real shared-memory transports, and one engine holding everything
to compare them with: shared by the DistAttention and lending tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from boundless.cluster.rmanager import RManager
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.lending import LendingAgent, LocalControlPlane
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

BLOCK = 16
CHUNK = 32  # the token budget of a step: a 100-token prompt is prefilled in 4 chunks
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = [(13 * j) % 300 + 3 for j in range(100)]  # 6 full blocks and 4 tokens
SHARED = LONG[:48] + [(7 * j) % 300 + 5 for j in range(20)]  # shares 3 full blocks with LONG: a prefix-cache hit
OTHER = [(11 * j) % 300 + 4 for j in range(40)]


def engine(
    loaded: LoadedModel,
    num_blocks: int = 40,
    max_model_len: int = 512,
    attention_backend: str = "torch",
    kv_cache_dtype: str = "auto",
) -> EngineCore:
    """An engine of ``num_blocks`` blocks, its KV held in ``kv_cache_dtype``; ``max_model_len`` may exceed its pool,
    as with lending a request may hold the cluster's memory (``bench longctx`` sizes it so)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=min(max_model_len, num_blocks * BLOCK), attention_backend=attention_backend),
        cache=CacheConfig(num_kv_blocks=num_blocks, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=CHUNK),
    )
    layout = dataclasses.replace(size_engine(config, loaded.arch, loaded.dtype), max_model_len=max_model_len)
    return EngineCore(
        config,
        layout,
        ModelIdentity.of(loaded, layout),
        loaded.tokenizer,
        build_model_executor(loaded, config, layout),
    )


@dataclass
class Recorded:
    """Each request's sampled tokens, and the logits each was sampled from (by request, output index)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def add(self, delta) -> None:
        self.tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        self.cached[delta.request_id] = delta.num_cached_tokens


def record(core: EngineCore, rec: Recorded) -> None:
    runner = core.executor.runner
    forward = runner.forward

    def recording(sched, on_layer=None, before_layer=None, follows=None):
        step = forward(sched, on_layer, before_layer, follows)
        for row, chunk in enumerate(step.chunks):
            rec.logits[(chunk.request_id, chunk.num_output_tokens)] = step.logits[row].clone()
        return step

    runner.forward = recording


def step(core: EngineCore, rec: Recorded) -> None:
    for delta in core.step():
        rec.add(delta)


def reference(
    loaded: LoadedModel, requests: dict[str, list[int]], num_blocks: int = 40, kv_cache_dtype: str = "auto"
) -> Recorded:
    core, rec = engine(loaded, num_blocks, max(512, num_blocks * BLOCK), kv_cache_dtype=kv_cache_dtype), Recorded()
    record(core, rec)
    for rid, prompt in requests.items():
        core.add_request(rid, prompt, PARAMS)
    while core.has_unfinished():
        step(core, rec)
    return rec


@dataclass
class Cluster:
    agents: list[LendingAgent]
    nets: list[ShmTransport]
    control: LocalControlPlane

    def step_all(self, recs: list[Recorded]) -> None:
        for agent, rec in zip(self.agents, recs, strict=True):
            for delta in agent.step():
                rec.add(delta)

    def kill(self, index: int) -> None:
        """Instance ``index`` dies without a word: its agent and transport close, and it answers no control call."""
        agent = self.agents[index]
        agent.close()
        self.nets[index].close()
        self.control.down.add(agent.instance_id)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``make(loaded, n, clock=None, max_model_len=512, num_blocks=40, attention_backend="torch",
    kv_cache_dtype="auto")``: n engines of ``num_blocks`` blocks with lending agents; ``clock`` drives their
    rManagers."""
    made: list[Cluster] = []

    def make(
        loaded: LoadedModel,
        n: int,
        clock: Callable[[], float] | None = None,
        max_model_len: int = 512,
        num_blocks: int = 40,
        attention_backend: str = "torch",
        kv_cache_dtype: str = "auto",
    ) -> Cluster:
        control = LocalControlPlane()
        nets = [ShmTransport(tmp_path / f"shm{len(made)}", f"i{i}", timeout_s=10) for i in range(n)]
        agents = []
        for net in nets:
            core = engine(loaded, num_blocks, max_model_len, attention_backend, kv_cache_dtype)
            rm = RManager(net.address, core.layout.num_blocks, BLOCK, clock or core.clock, reservation_timeout_s=30)
            agents.append(control.add(LendingAgent(core, rm, net, control, timeout_s=10)))
        cluster = Cluster(agents, nets, control)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        for agent in cluster.agents:
            agent.close()
        for net in cluster.nets:
            net.close()
