"""The cluster simulator: N real engines behind the real dispatcher and router, in virtual time."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from boundless.bench.workloads import ProgramSpec, make_programs
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.sim.engine import SimulatedModel
from boundless.sim.simulator import SimResult, Simulator


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


def _run(
    model: SimulatedModel, programs: list[ProgramSpec], cluster: ClusterConfig
) -> tuple[Simulator, list[SimResult]]:
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=200), scheduler=SchedulerConfig(policy="plas"))
    sim = Simulator(config, model, instances=cluster.instances, cluster=cluster)
    results = sim.run(programs)
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)  # every call ran
    return sim, results


def _homes(sim: Simulator) -> dict[str, set[str]]:
    homes: dict[str, set[str]] = defaultdict(set)
    for p in sim.placements:
        homes[p.program_id].add(p.instance_id)
    return homes


def test_a_cluster_run_is_a_function_of_its_seed(model: SimulatedModel) -> None:
    cluster = ClusterConfig(instances=3)
    first, results = _run(model, make_programs("chat", 24, rate=1.0, seed=3), cluster)
    again, again_results = _run(model, make_programs("chat", 24, rate=1.0, seed=3), cluster)
    _, other_results = _run(model, make_programs("chat", 24, rate=1.0, seed=4), cluster)
    assert results == again_results and first.placements == again.placements
    assert results != other_results
    assert len({p.instance_id for p in first.placements}) == 3  # the load is spread


def test_locality_routing_keeps_a_programs_calls_on_its_instance(model: SimulatedModel) -> None:
    programs = make_programs("chat", 16, rate=2.0, seed=1)
    assert sum(p.num_calls > 1 for p in programs) >= 4
    # Every call counts as long (threshold 0) and the home is never too busy to leave: the router's rule alone.
    local, _ = _run(model, programs, ClusterConfig(instances=4, locality_threshold=0, locality_max_imbalance=10**6))
    assert all(len(instances) == 1 for instances in _homes(local).values())
    assert len({p.instance_id for p in local.placements}) == 4
    # Round robin (the same router, another mode) scatters programs over the instances.
    scattered, _ = _run(model, programs, ClusterConfig(instances=4, routing="round-robin"))
    assert any(len(instances) > 1 for instances in _homes(scattered).values())


def test_short_calls_go_to_the_least_loaded_instance(model: SimulatedModel) -> None:
    # Past the threshold nothing is long: every call goes to the least-loaded instance, so programs move.
    programs = make_programs("chat", 16, rate=2.0, seed=1)
    spread, _ = _run(model, programs, ClusterConfig(instances=4, locality_threshold=10**6))
    assert any(len(instances) > 1 for instances in _homes(spread).values())


def test_one_instance_behind_the_cluster_flags_is_the_single_engine(model: SimulatedModel) -> None:
    programs = make_programs("chat", 10, rate=0.5, seed=2)
    single, one_results = _run(model, programs, ClusterConfig(instances=1))
    assert {p.instance_id for p in single.placements} == {"0"} and single.dispatcher is None
    _, two_results = _run(model, programs, ClusterConfig(instances=2))
    # Two instances share the load: programs finish no later on average.
    assert sum(r.latency_s for r in two_results) <= sum(r.latency_s for r in one_results)


def test_simulate_command_runs_a_cluster_on_a_gpu_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    args = ["simulate", "--instances", "2", "--profile", "h100", "--policies", "plas", "--rates", "2"]
    assert main([*args, "--num-programs", "12", "--num-kv-blocks", "400", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert result["instances"] == 2 and result["profile"] == "h100" and row["failed_calls"] == 0
    assert set(row["calls_per_instance"]) == {"0", "1"} and min(row["calls_per_instance"].values()) > 0
    assert result["speed"]["simulated_s"] == row["simulated_s"] > 0 and result["speed"]["wall_s"] > 0
    assert result["speed"]["cpu_s"] > 0 and len(result["speed"]["row_cpu_s"]) == len(result["rows"])
    captured = capsys.readouterr()
    assert "sim s" in captured.err and "simulated s per wall s" in captured.out  # the bar on stderr, speed on stdout
