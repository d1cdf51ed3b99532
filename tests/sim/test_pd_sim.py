"""Prefill and decode engines in the simulator: the real PDDispatcher, KV streams and reads in virtual time."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from boundless.bench.workloads import ProgramSpec, WorkloadShape, agent_sessions
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import ChunkShape
from boundless.sim.engine import SimulatedModel
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import HardwareProfile, load_profile
from boundless.sim.simulator import SimResult, Simulator

SHAPE = WorkloadShape(scale=0.05, call_scale=0.25, tool_wait_s=0.1)  # ~800-token contexts, 8 turns


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


def _run(
    model: SimulatedModel,
    kv_path: str,
    seed: int = 1,
    profile: HardwareProfile | None = None,
    storage_gbps: float | None = None,
) -> tuple[Simulator, list[SimResult], list[ProgramSpec]]:
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=400, kv_disk_path="unused-by-the-simulator", kv_host_gb=0.5),
        scheduler=SchedulerConfig(policy="fcfs"),
    )
    cluster = ClusterConfig(prefill_instances=1, decode_instances=2, kv_path=kv_path, storage_gbps=storage_gbps)
    programs = agent_sessions(6, 0.0, seed, SHAPE)
    sim = Simulator(config, model, cluster=cluster, profile=profile or load_profile("h100"))
    results = sim.run(programs)
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)  # every call ran
    assert not any(r.failed_calls for r in results)
    return sim, results, programs


def _storage_bytes(sim: Simulator) -> list[int]:
    return [link.stats().bytes_carried["kv"] for link in sim.storage_links]


def test_a_pd_run_is_a_function_of_its_seed(model: SimulatedModel) -> None:
    first, results, _ = _run(model, "dualpath")
    again, again_results, _ = _run(model, "dualpath")
    _, other_results, _ = _run(model, "dualpath", seed=2)
    assert results == again_results and first.placements == again.placements
    assert _storage_bytes(first) == _storage_bytes(again)
    assert results != other_results


def test_every_call_is_prefilled_on_a_pe_and_handed_to_a_de_over_the_network(model: SimulatedModel) -> None:
    sim, _, programs = _run(model, "basic")
    calls = sum(p.num_calls for p in programs)
    assert {p.instance_id for p in sim.placements} == {"p0"}  # the PE takes every call; the DEs are prepared
    pe = sim.instances["p0"].core.stats().remote_io
    des = [sim.instances[d].core.stats().remote_io for d in ("d0", "d1")]
    # A handoff stream per call, but for calls whose DE holds the whole prompt already (nothing to send).
    assert pe is not None and calls // 2 < pe.streams_sent <= calls
    assert sum(d.streams_received for d in des) == pe.streams_sent and all(d.streams_received for d in des)
    assert sum(d.bytes_received for d in des) == pe.bytes_sent > 0
    # The streams take virtual time on the PE's network link: a slower network makes the same job slower.
    h100 = load_profile("h100")
    slow, _, _ = _run(
        model, "basic", profile=dataclasses.replace(h100, network=LinkSpec(h100.network.bytes_per_s / 100))
    )
    assert slow.clock.now > sim.clock.now


def test_basic_reads_on_the_prefill_node_dualpath_on_both_oracle_on_none(model: SimulatedModel) -> None:
    basic, _, _ = _run(model, "basic")
    assert set(basic.dispatcher.placements) <= {"pe", "none"} and basic.dispatcher.placements["pe"] > 0
    pe_node, *de_nodes = _storage_bytes(basic)
    assert pe_node > 0 and not any(de_nodes)  # only the PE's storage NIC reads

    dual, _, _ = _run(model, "dualpath")
    assert dual.dispatcher.placements["de"] > 0  # some reads go the DE's way ...
    assert sum(b > 0 for b in _storage_bytes(dual)) >= 2  # ... over the DEs' storage NICs
    de = dual.instances["d0"].core.stats().remote_io
    assert de is not None and de.streams_sent > 0  # a DE pushes what it read to the PE

    oracle, _, _ = _run(model, "oracle")
    assert set(oracle.dispatcher.placements) == {"none"} and oracle.storage_links == []


def test_storage_nics_set_by_the_cluster_flag_bound_the_prefill_engines_reads(model: SimulatedModel) -> None:
    fast, _, _ = _run(model, "basic")
    slow, _, _ = _run(model, "basic", storage_gbps=1.0)  # 125 MB/s per engine instead of the h100's 12.5 GB/s
    assert slow.storage_links[0].bytes_per_s == 1.0e9 / 8
    assert _storage_bytes(slow)[0] > 0 and slow.clock.now > fast.clock.now


def test_simulate_sweeps_cluster_sizes_and_read_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    args = ["simulate", "--workload", "agent", "--policies", "fcfs", "--rates", "0", "--num-programs", "3"]
    args += ["--scale", "0.05", "--call-scale", "0.25", "--roles", "1:1,2:2", "--kv-paths", "basic,oracle"]
    args += ["--profile", "h100", "--num-kv-blocks", "400", "--kv-disk-path", "unused", "--kv-host-gb", "0.5"]
    assert main([*args, "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["roles"], r["kv_path"], r["gpus"]) for r in rows] == [
        ("1P1D", "basic", 2),
        ("1P1D", "oracle", 2),
        ("2P2D", "basic", 4),
        ("2P2D", "oracle", 4),
    ]
    assert all(r["jct_s"] > 0 and r["failed_calls"] == 0 for r in rows)
    assert rows[1]["read_paths"] == {"none": 24} and rows[1]["storage_bytes_read"] == {}
    assert "JCT vs basic" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("roles", [True, False])
def test_a_roofline_profile_counts_the_kv_in_the_kv_cache_s_type(model: SimulatedModel, roles: bool) -> None:
    """With --kv-cache-dtype fp8 a roofline GPU profile's KV is a byte an element, not its model's two: the KV a step
    reads (its time) and the blocks the tiers, the store and the network move are half a bf16 cache's, as the
    engines' pools hold them."""
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1) if roles else ClusterConfig(instances=1)
    h100 = load_profile("h100")
    sims = {}
    for kv in ("auto", "fp8"):
        config = EngineConfig(
            cache=CacheConfig(num_kv_blocks=400, kv_host_gb=0.5, kv_cache_dtype=kv),
            scheduler=SchedulerConfig(policy="fcfs"),
        )
        sims[kv] = Simulator(config, model, cluster=cluster, profile=h100)
    iid = "d0" if roles else "0"
    auto, fp8 = (sims[kv].instances[iid].core.executor for kv in ("auto", "fp8"))
    assert fp8.cost.shape.kv_bytes_per_token * 2 == auto.cost.shape.kv_bytes_per_token  # type: ignore[attr-defined]
    decode = [ChunkShape(cached=8192, new=1)] * 64  # memory-bound: the KV reads dominate
    assert fp8.cost.predict(decode) < auto.cost.predict(decode)  # type: ignore[attr-defined]
    if roles:  # the handoffs' and reads' blocks (the profile's model's), in the KV's type
        assert fp8.bytes_per_block * 2 == auto.bytes_per_block
    assert h100.step.shape.kv_bytes_per_element is None  # type: ignore[attr-defined]  # (the profile is left as it was)
