"""KV lending between engines of a model split over two tensor-parallel ranks (``engine/split_lending.py``), in one
process over real shared-memory endpoints, one for each rank of each engine: each rank moves its share of a move's
blocks to the creditor's rank of its number, and asks it for its heads' partials. The answers are one device's,
token for token; a round trip that fails on one rank alone fails the step on every rank, and the request is
recomputed with the same answer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lending_helpers import BLOCK, CHUNK, LONG, PARAMS, reference

from boundless.cluster.rmanager import RManager
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.lending import LendingAgent, LocalControlPlane
from boundless.engine.rank_process import RankEndpoint
from boundless.engine.split_lending import lending_address
from boundless.engine.tensor_parallel import TensorParallelRanks
from boundless.model.loader import load_configured_model
from boundless.transport.base import KVTransport
from boundless.transport.blocks import send_blocks
from boundless.transport.endpoints import EndpointSpec, open_endpoint, rank_address

TIMEOUT_S = 5.0


@dataclass
class SplitCluster:
    agents: list[LendingAgent] = field(default_factory=list)
    nets: list[KVTransport] = field(default_factory=list)
    control: LocalControlPlane = field(default_factory=LocalControlPlane)


def _ranks(agent: LendingAgent) -> TensorParallelRanks:
    ranks = agent.core.executor.runner.ranks  # type: ignore[attr-defined]
    assert ranks is not None
    return ranks


@pytest.fixture
def split_cluster(model_dirs: dict[str, Path], tmp_path: Path) -> Iterator[Callable[[int], SplitCluster]]:
    """``make(n)``: n engines of tiny-llama split over two ranks, each with a lending agent whose instance id is its
    ranks' endpoints' addresses."""
    made: list[SplitCluster] = []

    def make(n: int) -> SplitCluster:
        cluster = SplitCluster()
        made.append(cluster)
        config = EngineConfig(
            ModelConfig(model=str(model_dirs["tiny-llama"]), max_model_len=512, tensor_parallel_size=2),
            CacheConfig(num_kv_blocks=40, enable_prefix_caching=True),
            SchedulerConfig(policy="fcfs", max_num_batched_tokens=CHUNK),
        )
        for i in range(n):
            core = EngineCore.from_model(load_configured_model(config.model), config)
            spec = EndpointSpec("shm", str(tmp_path / "lend"), i, n, TIMEOUT_S)
            net = open_endpoint(spec)
            cluster.nets.append(net)
            address = lending_address(core, net, RankEndpoint(spec, ClusterConfig(), TIMEOUT_S, layerwise=False))
            rm = RManager(address, core.layout.num_blocks, BLOCK, core.clock, reservation_timeout_s=30)
            cluster.agents.append(cluster.control.add(LendingAgent(core, rm, net, cluster.control, TIMEOUT_S)))
        return cluster

    yield make
    for cluster in made:
        for agent in cluster.agents:
            agent.close()
            agent.core.close()
        for net in cluster.nets:
            net.close()


def _step_until(cluster: SplitCluster, tokens: list[int], done: Callable[[], bool], limit: int = 300) -> None:
    """Step the debtor (agent 0) and the creditors still up until ``done``; the debtor's tokens into ``tokens``."""
    for _ in range(limit):
        if done():
            return
        for delta in cluster.agents[0].step():
            tokens += delta.new_token_ids
        for agent in cluster.agents[1:]:
            if agent.instance_id not in cluster.control.down:
                agent.step()
    raise AssertionError("not done in time")


def test_split_engines_lend_and_attend_rank_to_rank_with_one_devices_answer(load, split_cluster) -> None:
    want = reference(load("tiny-llama"), {"long": LONG}).tokens["long"]
    cluster = split_cluster(3)
    debtor, c1, c2 = cluster.agents
    for agent in cluster.agents:  # (an instance's address: its two ranks' endpoints, apart)
        assert rank_address(agent.instance_id, 0) != rank_address(agent.instance_id, 1)
    debtor.core.add_request("long", LONG, PARAMS)
    tokens: list[int] = []
    request = debtor.core.scheduler.requests["long"]
    _step_until(cluster, tokens, lambda: request.num_computed_tokens >= 2 * CHUNK)
    assert debtor.move_kvcache("long", 3, c1.instance_id)
    assert debtor.core.kv.num_lent_blocks("long") == 3 and c1.core.kv.pool.num_used == 3 and c1.rm.lent_blocks == 3
    _step_until(cluster, tokens, lambda: request.num_computed_tokens >= len(LONG) + 3)
    assert debtor.move_kvcache("long", 2, c2.instance_id)  # blocks computed with remote attention move on
    _step_until(cluster, tokens, lambda: not debtor.core.has_unfinished())
    # Each rank attended over its heads' share on the creditors' rank of its number: a rank missing its share of a
    # lent block (or attending over rank 0's) would answer otherwise.
    assert tokens == want and debtor.stats.requests_recomputed == 0  # (not by computing the blocks again)
    assert debtor.stats.moves_out == 2 and debtor.stats.blocks_out == 5
    assert debtor.stats.bytes_out == 5 * debtor.core.block_bytes == 5 * 2 * debtor.core.layout.bytes_per_block
    served = c1.data.server.stats.round_trips + c2.data.server.stats.round_trips  # (rank 0's)
    assert served == debtor.data.client.stats.round_trips > 0
    assert c1.rm.lent_blocks == 0 and c2.rm.lent_blocks == 0 and c1.core.kv.pool.num_used == 0


@pytest.mark.parametrize("lost", [pytest.param("rank 1", marks=pytest.mark.slow), "rank 0"])  # (6 s each)
def test_a_round_trip_failing_on_one_rank_fails_the_step_on_every_rank_and_the_request_is_recomputed(
    load, split_cluster, lost: str
) -> None:
    """The creditor's second rank dies (the debtor's rank 1's round trips fail, rank 0's answer), or its rank 0's
    endpoint and partial server close (the other way round): the ranks agree after the last layer, the step is
    dropped on every rank (none waits at a sum for ever), the creditor is taken as lost, and the request is computed
    again here with the same answer."""
    want = reference(load("tiny-llama"), {"long": LONG}).tokens["long"]
    cluster = split_cluster(2)
    debtor, creditor = cluster.agents
    debtor.core.add_request("long", LONG, PARAMS)
    tokens: list[int] = []
    request = debtor.core.scheduler.requests["long"]
    _step_until(cluster, tokens, lambda: request.num_computed_tokens >= 2 * CHUNK)
    assert debtor.move_kvcache("long", 3, creditor.instance_id)
    _step_until(cluster, tokens, lambda: len(tokens) >= 3)
    if lost == "rank 1":
        _ranks(creditor).processes[0].kill()
    else:
        creditor.data.close()
        cluster.nets[1].close()
    cluster.control.down.add(creditor.instance_id)
    _step_until(cluster, tokens, lambda: not debtor.core.has_unfinished())
    assert tokens == want
    assert debtor.stats.requests_recomputed == 1 and debtor.core.kv.num_lent_blocks("long") == 0
    assert creditor.instance_id in debtor.rm.lost_peers
    assert _ranks(debtor).lost is None  # (the debtor's ranks are in step: no sum was left waiting)


class _LostConfirm(LocalControlPlane):
    """A confirm whose answer is lost (a Ray call past its timeout): the debtor gives the move up."""

    def confirm_blocks(self, creditor: str, move_id: str, receive: object) -> bool:
        return False


@pytest.mark.slow  # (11 s of split engines)
def test_a_move_given_up_is_cancelled_on_every_rank_and_its_late_words_never_confirm_another(split_cluster) -> None:
    """A move whose confirm is lost is given up by the creditor (every rank's receive cancelled, no word of it kept);
    then a move on the same tag (the debtor restarted at its address numbers its moves from 0 again) whose second rank
    never sends its share fails: the first move's late word is not taken for the second's."""
    cluster = split_cluster(2)
    debtor, creditor = cluster.agents
    debtor.core.add_request("long", LONG, PARAMS)
    request = debtor.core.scheduler.requests["long"]
    _step_until(cluster, [], lambda: request.num_computed_tokens >= 2 * CHUNK)
    good = debtor.control
    lost = _LostConfirm()
    lost.agents = cluster.control.agents
    debtor.control = lost
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    creditor.observe()  # (the released move's receive is given up: the creditor's blocks are free again)
    assert creditor.core.kv.pool.num_used == 0 and not creditor.rm.loans
    assert not _ranks(creditor).lent  # (no word awaited, none kept)
    debtor.control = good
    debtor.rm._next_move = 0  # the same move id, and tag, again
    data = debtor.data

    def rank_0s_share(creditor_id: str, tag: int, ids: list[int]) -> object:  # (the debtor's rank 1 sends nothing)
        return send_blocks(data.transport, rank_address(creditor_id, 0), tag, data.cache, ids)

    data.send_blocks = rank_0s_share
    assert not debtor.move_kvcache("long", 2, creditor.instance_id)
    assert creditor.core.kv.pool.num_used == 0 and debtor.core.kv.num_lent_blocks("long") == 0
