"""A model split over GPUs in the simulator (``boundless simulate --tensor-parallel-size N`` on a roofline profile):
each GPU's share of a step plus the all-reduces over the node's interconnect, links of every GPU, memory of every GPU,
and what it refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from boundless.bench.workloads import make_programs
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import ChunkShape
from boundless.sim.engine import SimulatedModel
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import RooflineStepCost, load_profile, profile_from_dict, with_tensor_parallel
from boundless.sim.simulator import Simulator

H200 = load_profile("h200")


def _step(profile_step: object) -> RooflineStepCost:
    assert isinstance(profile_step, RooflineStepCost)
    return profile_step


def test_a_split_step_is_one_gpus_share_plus_two_all_reduces_a_layer() -> None:
    one, two = _step(H200.step), _step(with_tensor_parallel(H200, 2).step)
    shape, link = one.shape, H200.gpu_interconnect
    assert link is not None and link.bytes_per_s == 450e9  # NVLink, each way
    hidden_bytes = shape.q_heads * shape.head_dim * 2
    for chunks in ([ChunkShape(2000, 1)] * 64, [ChunkShape(0, 4096)], [ChunkShape(8000, 1)] * 8):
        tokens = sum(c.new for c in chunks)
        # Each GPU: half the FLOPs, half the weights, half the key/value heads (8 of Llama-3.1-8B's, 4 each).
        share = (one.predict(chunks) - one.step_overhead_s) / 2
        sums = 2 * shape.layers * (link.latency_s + 2 * (2 - 1) / 2 * tokens * hidden_bytes / link.bytes_per_s)
        assert two.predict(chunks) == pytest.approx(one.step_overhead_s + share + sums, rel=1e-9)
    # A batch-64 decode of Llama-3.1-8B is weight-bound: the split is faster, but not twice (the sums, the overhead).
    decode = [ChunkShape(2000, 1)] * 64
    assert one.predict(decode) / 2 < two.predict(decode) < one.predict(decode)


def test_key_value_heads_fewer_than_the_gpus_are_held_whole_by_each() -> None:
    """Llama-3.1-8B's 8 key/value heads over 16 GPUs: each holds one (replicated), so a GPU reads 1/8 of the KV, not
    1/16; its weights are 1/16."""
    sixteen = _step(with_tensor_parallel(H200, 16).step)
    eight = _step(with_tensor_parallel(H200, 8).step)
    assert sixteen._factors[3] == eight._factors[3] == H200.step.shape.kv_bytes_per_token / 8  # type: ignore[attr-defined]
    assert sixteen._factors[2] == eight._factors[2] / 2


def test_an_instance_of_a_split_model_moves_kv_over_every_gpus_links() -> None:
    """Each GPU moves its share of a block; over 16 GPUs, one of Llama-3.1-8B's 8 key/value heads each: 8 links."""
    four, sixteen = with_tensor_parallel(H200, 4), with_tensor_parallel(H200, 16)
    for name in ("host_copy", "storage_read", "storage_write", "network"):
        assert getattr(four, name).bytes_per_s == 4 * getattr(H200, name).bytes_per_s
        assert getattr(four, name).latency_s == getattr(H200, name).latency_s
        assert getattr(sixteen, name).bytes_per_s == 8 * getattr(H200, name).bytes_per_s
    assert with_tensor_parallel(H200, 1) is H200


def test_the_sums_cost_their_bytes_over_a_link_of_no_latency() -> None:
    slow = dataclasses.replace(H200, gpu_interconnect=LinkSpec(1e9, 0.0))
    prefill = [ChunkShape(0, 4096)]
    assert (
        _step(with_tensor_parallel(slow, 2).step).predict(prefill)
        > _step(with_tensor_parallel(H200, 2).step).predict(prefill) + 0.5
    )  # 64 sums of 4096 x 8 KiB at 1 GB/s: ~2.1 s


def test_a_profile_that_cannot_price_a_split_model_is_refused() -> None:
    with pytest.raises(ValueError, match="fitted to one device's steps"):
        with_tensor_parallel(load_profile("cpu"), 2)
    with pytest.raises(ValueError, match="32 attention heads and 8 key/value heads do not split over 3"):
        with_tensor_parallel(H200, 3)
    bare = json.loads((Path(__file__).parents[2] / "boundless/sim/profiles/h200.json").read_text())
    del bare["links"]["gpu_interconnect"]
    with pytest.raises(ValueError, match=r"no links\.gpu_interconnect"):
        with_tensor_parallel(profile_from_dict(bare), 2)


def _simulator(tp: int, cache: CacheConfig, cluster: ClusterConfig | None = None) -> Simulator:
    config = EngineConfig(
        ModelConfig(tensor_parallel_size=tp, max_model_len=4096), cache, SchedulerConfig(policy="plas", max_num_seqs=64)
    )
    return Simulator(config, SimulatedModel.read(ModelConfig()), profile=H200, cluster=cluster)


def test_a_split_engine_holds_every_gpus_memory_and_serves_faster() -> None:
    """Memory flags are each GPU's (as the real ranks'): two GPUs hold twice one's blocks, host blocks too; the same
    programs end sooner on one instance of two GPUs than on one of one."""
    cache = CacheConfig(kv_cache_gb=0.5, kv_host_gb=0.25)
    one, two = _simulator(1, cache), _simulator(2, cache)
    assert two.core.layout.num_blocks == 2 * one.core.layout.num_blocks
    assert two.core.layout.num_host_blocks == 2 * one.core.layout.num_host_blocks
    assert two.gpus_per_instance == 2
    # The bookkeeping model (SmolLM2's 3 key/value heads) over 4 GPUs: one head of every block each, 3 times one's.
    assert _simulator(4, cache).core.layout.num_blocks == 3 * one.core.layout.num_blocks
    swap = CacheConfig(kv_cache_gb=0.5, swap_space_gb=0.0)  # (no host memory: none on any GPU)
    assert _simulator(2, swap).core.layout.num_host_blocks == 0
    programs = make_programs("chat", 40, rate=4.0, seed=3)
    ends = []
    for sim in (one, two):
        results = sim.run(programs)
        assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)  # every call ran
        ends.append(max(r.finish_s for r in results))
    assert ends[1] < ends[0]


def test_the_simulator_refuses_a_split_model_it_cannot_price_or_serve() -> None:
    config = EngineConfig(ModelConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="on a roofline --profile"):
        Simulator(config, SimulatedModel.read(ModelConfig()))
    with pytest.raises(ConfigError, match="fitted to one device's steps"):
        Simulator(config, SimulatedModel.read(ModelConfig()), profile=load_profile("cpu"))


def test_simulate_takes_a_split_model_on_a_roofline_profile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "tp.json"
    args = ["simulate", "--policies", "plas", "--rates", "4", "--num-programs", "20", "--profile", "h200"]
    assert main([*args, "--num-kv-blocks", "2000", "-tp", "2", "--instances", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["gpus"] == 4 and row["instances"] == 2 and row["failed_calls"] == 0
    assert "of 2 instance(s) (4 GPUs)" in capsys.readouterr().out
    # Prefill and decode engines of a split model (each GPU's NIC carries its share of a handoff).
    pd = ["--prefill-instances", "1", "--decode-instances", "1"]
    assert main([*args, "--num-kv-blocks", "2000", "-tp", "2", *pd, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["roles"], row["gpus"], row["failed_calls"], row["programs_finished"]) == ("1P1D", 4, 0, 20)
    assert main(["simulate", "--num-programs", "2", "-tp", "2"]) == 2
    assert "prices a model split over GPUs on a roofline --profile" in capsys.readouterr().err


def test_split_instances_lend_over_every_gpus_nic_in_the_simulator() -> None:
    """``--kv-lending on`` with ``-tp 2`` (``serve`` runs it rank to rank): a request of twice one instance's pool is
    served through moves and round trips, over links of both GPUs; a ``--net-gbps`` link is one GPU's, as ``serve``
    gives each rank its own."""
    from boundless.bench.longctx_trace import TraceShape, make_trace
    from boundless.sim.longctx import longctx_row, pool_tokens, trace_programs

    config = EngineConfig(
        ModelConfig(tensor_parallel_size=2),
        CacheConfig(num_kv_blocks=64, kv_host_gb=0.0),
        SchedulerConfig(max_num_batched_tokens=256),
    )
    model = SimulatedModel.read(ModelConfig())
    cluster = ClusterConfig(
        instances=3, kv_lending="on", net_gbps=10.0, heartbeat_interval_s=0.1, lending_interval_s=0.1,
        lending_creditor_max_usage=0.9, lending_creditor_headroom=0.05,
    )  # fmt: skip
    sim = Simulator(config, model, None, instances=3, cluster=cluster, profile=H200, compact_prompts=False)
    assert sim.lending is not None
    assert {d.link.bytes_per_s for d in sim.lending.data.values()} == {2 * 10e9 / 8}
    pool = pool_tokens(config, model)
    trace = make_trace(TraceShape(num_short=6, long_factors=(2.0,)), pool, model.identity.vocab_size, 2.0, seed=0)
    programs = trace_programs(trace)
    row = longctx_row(sim, sim.run(programs), programs, 2.0, "lending")
    assert row["served"] == row["requests"] and row["longest_served"] > 1.5 * pool
    assert row["lending"]["moves"] > 0 and row["lending"]["round_trips"] > 0
