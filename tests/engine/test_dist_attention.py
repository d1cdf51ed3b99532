"""DistAttention across engines in one process over a real shared-memory transport: a debtor moves leading blocks
of a request to one or two creditors mid-prefill and mid-decode, and goes on with its prefill chunks and decodes
attending to them there. Greedy outputs equal one engine's holding everything, and the logits agree to 1e-4;
each block on each side holds its own tokens' KV."""

from __future__ import annotations

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


def _core(loaded: LoadedModel) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(num_kv_blocks=40, enable_prefix_caching=True),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=CHUNK),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    return EngineCore(
        config, layout, ModelIdentity.of(loaded), loaded.tokenizer, build_model_executor(loaded, config, layout)
    )


@dataclass
class Recorded:
    """Each request's sampled tokens, and the logits each was sampled from (by request, output index)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


def _record(core: EngineCore, rec: Recorded) -> None:
    runner = core.executor.runner
    forward = runner.forward

    def recording(sched, on_layer=None):
        step = forward(sched, on_layer)
        for row, chunk in enumerate(step.chunks):
            rec.logits[(chunk.request_id, chunk.num_output_tokens)] = step.logits[row].clone()
        return step

    runner.forward = recording


def _step(core: EngineCore, rec: Recorded) -> None:
    for delta in core.step():
        rec.tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        rec.cached[delta.request_id] = delta.num_cached_tokens


def _reference(loaded: LoadedModel, requests: dict[str, list[int]]) -> Recorded:
    core, rec = _core(loaded), Recorded()
    _record(core, rec)
    for rid, prompt in requests.items():
        core.add_request(rid, prompt, PARAMS)
    while core.has_unfinished():
        _step(core, rec)
    return rec


@dataclass
class Cluster:
    agents: list[LendingAgent]
    nets: list[ShmTransport]
    control: LocalControlPlane

    def step_all(self, recs: list[Recorded]) -> None:
        for agent, rec in zip(self.agents, recs, strict=True):
            if agent.core.has_unfinished():
                _step(agent.core, rec)
            agent.observe()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[[LoadedModel, int], Cluster]]:
    made: list[Cluster] = []

    def make(loaded: LoadedModel, n: int) -> Cluster:
        control = LocalControlPlane()
        nets = [ShmTransport(tmp_path / f"shm{len(made)}", f"i{i}", timeout_s=10) for i in range(n)]
        agents = []
        for net in nets:
            core = _core(loaded)
            rm = RManager(net.address, core.layout.num_blocks, BLOCK, core.clock, reservation_timeout_s=30)
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


def _computed(core: EngineCore, rid: str) -> int:
    return core.scheduler.requests[rid].num_computed_tokens


def _assert_same(got: Recorded, want: Recorded, rids: list[str]) -> None:
    for rid in rids:
        assert got.tokens[rid] == want.tokens[rid], rid
        for i in range(len(want.tokens[rid])):
            torch.testing.assert_close(got.logits[(rid, i)], want.logits[(rid, i)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])  # GQA, MHA
@pytest.mark.parametrize("instances", [2, 3])
def test_distattention_matches_one_instance(load, make_cluster, model: str, instances: int) -> None:
    loaded = load(model)
    want = _reference(loaded, {"long": LONG, "shared": SHARED, "other": OTHER})
    cluster = make_cluster(loaded, instances)
    debtor, creditors = cluster.agents[0], cluster.agents[1:]
    recs = [Recorded() for _ in cluster.agents]
    for agent, rec in zip(cluster.agents, recs, strict=True):
        _record(agent.core, rec)
    debtor.core.add_request("long", LONG, PARAMS)
    creditors[0].core.add_request("other", OTHER, PARAMS)  # the creditor serves its own request meanwhile
    second = creditors[-1].instance_id
    # Prefill: after 2 chunks (4 full blocks), blocks 0-1 go to the first creditor; the next chunks attend to them.
    while _computed(debtor.core, "long") < 2 * CHUNK:
        cluster.step_all(recs)
    assert debtor.move_kvcache("long", 2, creditors[0].instance_id)
    cluster.step_all(recs)  # a prefill chunk over remote blocks
    assert _computed(debtor.core, "long") == 3 * CHUNK
    # Block 2 goes to the last creditor (the same one on 2 instances: two spans there).
    assert debtor.move_kvcache("long", 1, second)
    debtor.core.add_request("shared", SHARED, PARAMS)  # hits the prefix cache: LONG's first 3 blocks, still named
    while len(recs[0].tokens.get("long", [])) < 4:
        cluster.step_all(recs)
    # Mid-decode: two more blocks to the first creditor.
    assert debtor.move_kvcache("long", 2, creditors[0].instance_id)
    first, remote = debtor.core.kv.remote_prefix("long")
    assert first == 5 and sum(kv.num_tokens for kv in remote) == 5 * BLOCK
    assert {kv.creditor for kv in remote} == {c.instance_id for c in creditors}
    while any(a.core.has_unfinished() for a in cluster.agents):
        cluster.step_all(recs)
    got = Recorded(tokens={**recs[0].tokens, **recs[1].tokens}, logits={**recs[0].logits, **recs[1].logits})
    _assert_same(got, want, ["long", "shared", "other"])
    assert recs[0].cached["shared"] == 3 * BLOCK  # a prefix-cache hit on the debtor, beside the remote request
    # Every layer of every step of "long" after the first move asked its creditors: round trips happened.
    assert debtor.client.stats.round_trips > 0 and debtor.attention.stats.layers > 0
    # The request finished: its creditors freed its blocks; nothing is left lent anywhere.
    for c in creditors:
        assert not c.rm.loans and c.core.kv.pool.num_used == 0
    assert debtor.stats.blocks_out == 5 and sum(c.stats.blocks_in for c in creditors) == 5
