"""A plain cluster in windows of virtual time, its engines in worker processes (``sim/parallel.py``): the rows are a
function of the flags, the seed and the window alone, whatever the number of workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from boundless.bench.workloads import make_programs
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.executor import StepResult
from boundless.engine.scheduler import SchedulerOutput
from boundless.sim.engine import SimulatedModel
from boundless.sim.executor import CostModelExecutor
from boundless.sim.parallel import (
    MAIN_WORK_RATIO,
    SimulationWorkerError,
    WindowedSimulator,
    shard_owners,
)
from boundless.sim.simulator import Simulator


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


CONFIG = EngineConfig(cache=CacheConfig(num_kv_blocks=200), scheduler=SchedulerConfig(policy="plas"))


def _windowed(model: SimulatedModel, workers: int, pipeline: bool = False, interval: float = 0.05):
    sim = WindowedSimulator(CONFIG, model, instances=3, sync_interval_s=interval, workers=workers, pipeline=pipeline)
    programs = make_programs("chat", 12, rate=2.0, seed=5)
    results = sim.run(programs)
    assert all(r.finished for r in results)  # every program finished
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)  # every call ran in full
    return sim, results


@pytest.mark.parametrize(("pipeline", "workers"), [(False, 2), (True, 2), (False, 3)])
def test_one_worker_and_more_give_the_same_run(model: SimulatedModel, pipeline: bool, workers: int) -> None:
    one, one_results = _windowed(model, 1, pipeline)
    more, more_results = _windowed(model, workers, pipeline)
    assert one_results == more_results and one.placements == more.placements
    assert (one.num_steps, one.num_preemptions(), one.call_latencies) == (
        more.num_steps,
        more.num_preemptions(),
        more.call_latencies,
    )
    assert len({p.instance_id for p in one.placements}) == 3  # the router spread the load
    assert len(more.helper_cpu_s()) == workers - 1  # main ran a shard, the others were forked


def test_main_keeps_fewer_instances_than_a_worker_and_each_instance_is_in_one_shard() -> None:
    assert shard_owners(5, 1) == [[0, 1, 2, 3, 4]]
    owners = shard_owners(1152, 2)
    assert sorted(i for owned in owners for i in owned) == list(range(1152))
    assert len(owners[0]) == round(1152 * (1 - MAIN_WORK_RATIO) / 2)  # main's share: its routing is the rest
    assert owners[0][:2] == [1, 3] and owners[0][-1] > 1140  # interleaved over the ids
    many = shard_owners(40, 8)  # main's routing is a worker's share and more: it keeps none
    assert many[0] == [] and all(len(owned) == 40 // 7 or len(owned) == 40 // 7 + 1 for owned in many[1:])


def test_windows_move_the_results_a_little(model: SimulatedModel) -> None:
    # An observation, not a bound: the router hears of finishes up to a window late, and calls wait for the next window.
    serial = Simulator(CONFIG, model, instances=3, cluster=ClusterConfig(instances=3))
    programs = make_programs("chat", 12, rate=2.0, seed=5)
    serial_results = serial.run(programs)
    _, windowed = _windowed(model, 1, interval=0.01)
    assert [r.output_tokens for r in windowed] == [r.output_tokens for r in serial_results]
    latency = sum(r.latency_s for r in windowed) / sum(r.latency_s for r in serial_results)
    assert 0.8 < latency < 1.25


def _simulate(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "run.json"
    flags = ["simulate", "--policies", "plas", "--rates", "2", "--num-programs", "10", "--num-kv-blocks", "200"]
    assert main([*flags, "--no-progress", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_command_line_runs_it_and_reports_the_workers(tmp_path: Path) -> None:
    result = _simulate(tmp_path, "--instances", "3", "--workers", "2")  # D defaults with --workers > 1
    assert (result["workers"], result["sync_interval_s"]) == (2, 0.02)
    assert result["rows"][0]["programs_finished"] == 10 and result["speed"]["cpu_s"] > 0
    serial = _simulate(tmp_path, "--instances", "3")
    assert (serial["workers"], serial["sync_interval_s"]) == (1, None)


def test_refused_calls_are_refused_as_the_serial_run_refuses_them(tmp_path: Path) -> None:
    # A 48-token context: main refuses what the engine would (no shard sees such a call).
    serial = _simulate(tmp_path, "--instances", "2", "--max-model-len", "48")
    windowed = _simulate(tmp_path, "--instances", "2", "--max-model-len", "48", "--sync-interval-s", "0.02")
    assert windowed["rows"][0]["failed_calls"] == serial["rows"][0]["failed_calls"] > 0


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--roles", "1:1"], "--roles"),
        (["--kv-lending", "on"], "--kv-lending on"),
        (["--fail", "1@1"], "--fail"),
        (["--instances-per-node", "2"], "--instances-per-node"),
        (["--jobs", "2"], "--jobs"),
        (["--profile", "cpu-served-2inst"], "a contended profile"),
    ],
)
def test_what_a_windowed_run_does_not_simulate_is_refused(tmp_path: Path, flags: list[str], refused: str) -> None:
    with pytest.raises(SystemExit, match=f"plain instances that share nothing, not {refused}"):
        _simulate(tmp_path, "--instances", "2", "--sync-interval-s", "0.02", *flags)


def test_workers_are_counted_and_bounded(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--workers: at least 1"):
        _simulate(tmp_path, "--workers", "0")
    with pytest.raises(SystemExit, match="--workers: at most one per instance"):
        _simulate(tmp_path, "--instances", "2", "--workers", "3")
    with pytest.raises(SystemExit, match="--sync-interval-s: a positive number"):
        _simulate(tmp_path, "--instances", "2", "--sync-interval-s", "0")


def test_a_workers_exception_is_one_error_in_main(model: SimulatedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # A step of an engine in a worker fails (the executor: the shard's own code may be compiled, its calls not
    # patched).
    main_pid, execute = os.getpid(), CostModelExecutor.execute

    def broken(self: CostModelExecutor, sched: SchedulerOutput) -> StepResult:
        if os.getpid() == main_pid:  # main's own shard runs
            return execute(self, sched)
        raise ValueError("a shard's bug")

    monkeypatch.setattr(CostModelExecutor, "execute", broken)  # (the workers are forked: they have it too)
    with pytest.raises(SimulationWorkerError, match=r"(?s)simulation worker 1 failed.*a shard's bug"):
        _windowed(model, 2)
