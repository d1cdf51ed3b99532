"""Multi-step decoding in the simulator (``--num-scheduler-steps``): the real engine's windows, scheduled once per
window; deterministic for a seed; every call's tokens as with single steps, only the timing moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.bench.workloads import make_programs
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import load_profile
from boundless.sim.simulator import SimResult, Simulator


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


def _run(model: SimulatedModel, k: int, instances: int = 3, blocks: int = 300) -> tuple[Simulator, list[SimResult]]:
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=blocks), scheduler=SchedulerConfig(policy="plas", num_scheduler_steps=k)
    )
    sim = Simulator(
        config, model, instances=instances, cluster=ClusterConfig(instances=instances), profile=load_profile("h100")
    )
    return sim, sim.run(make_programs("chat", 24, rate=3.0, seed=2))


def test_windows_schedule_fewer_steps_and_every_call_keeps_its_tokens(model: SimulatedModel) -> None:
    one, one_results = _run(model, 1)
    many, many_results = _run(model, 8)
    assert one.num_scheduled == one.num_steps
    assert many.num_scheduled < many.num_steps / 3  # most steps ran inside windows
    assert [r.output_tokens for r in many_results] == [r.output_tokens for r in one_results]
    assert all(r.finished for r in many_results)
    # Only the timing moves: arrivals wait for a window's end, finishes are seen at it.
    assert many_results != one_results
    one_s = sum(r.latency_s for r in one_results)
    assert one_s * 0.8 < sum(r.latency_s for r in many_results) < one_s * 1.25


def test_a_run_with_windows_is_a_function_of_its_flags(tmp_path: Path) -> None:
    rows = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        args = ["simulate", "--instances", "3", "--profile", "h100", "--policies", "plas", "--rates", "3"]
        args += ["--num-programs", "18", "--num-kv-blocks", "300", "--num-scheduler-steps", "8", "--no-progress"]
        assert main([*args, "--json", str(out)]) == 0
        rows.append(json.loads(out.read_text()))
    assert rows[0]["rows"] == rows[1]["rows"]
    assert rows[0]["speed"]["steps_scheduled"] < rows[0]["speed"]["steps"]


def test_memory_pressure_with_windows_preempts_and_finishes_every_call(model: SimulatedModel) -> None:
    sim, results = _run(model, 8, instances=1, blocks=60)
    assert sim.core.scheduler.stats.num_preemptions > 0
    assert all(r.finished for r in results) and sim.core.kv.pool.num_used == 0
    assert sim.num_scheduled < sim.num_steps


def test_prefill_and_decode_roles_run_windows_on_the_decode_engines(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    args = ["simulate", "--workload", "agent", "--policies", "fcfs", "--rates", "0", "--num-programs", "6"]
    args += ["--scale", "0.05", "--call-scale", "0.25", "--roles", "1:2", "--kv-paths", "dualpath", "--profile"]
    args += ["h100", "--num-kv-blocks", "400", "--kv-host-gb", "0.5", "--kv-disk-path", "unused", "--kv-disk-gb", "1"]
    runs = []
    for k in ("1", "8"):
        assert main([*args, "--num-scheduler-steps", k, "--no-progress", "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    one, many = runs
    assert many["speed"]["steps_scheduled"] < many["speed"]["steps"]
    tokens = [r["output_tokens_per_s"] * r["jct_s"] for r in (one["rows"][0], many["rows"][0])]
    assert tokens[1] == pytest.approx(tokens[0])  # every call's output, either way
