"""The speed probe: a fixed grid timed on a fresh engine, kept by calibrate and read by validate, which predicts
each case again at the machine's speed so measured."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from boundless.bench.workloads import WorkloadShape, make_programs
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig
from boundless.engine.attention_time import ChunkShape
from boundless.model.loader import LoadedModel
from boundless.sim.calibrate import calibrate, calibrate_served
from boundless.sim.grid import CalibrationGrid
from boundless.sim.profiles import FittedStepCost, load_profile
from boundless.sim.speed_probe import at_speed, probe_seconds, speed_ratio
from boundless.sim.validate import Case, serve_and_measure, simulate, validate_case


def readings(*values: float) -> Callable[[], float]:
    """A probe that reads ``values`` in turn: the machine's speed, fixed for the test."""
    it: Iterator[float] = iter(values)
    return lambda: next(it)


def test_the_probe_times_its_grid_on_a_fresh_engine_on_the_threads_asked(tiny_llama: LoadedModel) -> None:
    threads = torch.get_num_threads()
    seconds = probe_seconds(tiny_llama, ModelConfig(), 1)
    assert seconds > 0 and torch.get_num_threads() == threads  # the process's threads are given back


def test_a_profile_at_a_speed_takes_that_many_times_each_steps_time() -> None:
    profile = load_profile("cpu-served")
    slower = at_speed(profile, 1.25)
    assert isinstance(slower.step, FittedStepCost)
    for shapes in ([ChunkShape(0, 300)], [ChunkShape(120, 1)] * 3, [ChunkShape(64, 32), ChunkShape(500, 1)]):
        assert slower.step.predict(shapes) == pytest.approx(1.25 * profile.step.predict(shapes))
    assert slower.host_copy == profile.host_copy and slower.probe_s == profile.probe_s
    with pytest.raises(ValueError, match="fitted"):
        at_speed(load_profile("h100"), 1.25)  # a GPU's published figures are not this machine's to probe
    assert speed_ratio([2.0, 3.0, 9.0], [1.0, 1.5, 2.0]) == 2.0  # medians: a burst in one reading moves nothing


def test_calibrate_reads_the_probe_around_its_grids_and_after_each_program_run(tiny_llama: LoadedModel) -> None:
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    grid = CalibrationGrid((1,), (8,), output_tokens=3, repeats=1)
    bare = calibrate(tiny_llama, config, grid, probe=readings(0.5, 0.7))
    assert bare.probe_s == (0.5, 0.7)
    run = make_programs("mapreduce", 2, 4.0, 101, WorkloadShape(scale=0.05, tool_wait_s=0.05))
    served = calibrate_served(
        tiny_llama, config, grid, arrivals=None, programs=([run, run], [run]), probe=readings(1, 2, 3, 4, 5)
    )
    assert served.probe_s == (1, 2, 3, 4, 5)  # before the grids, after them, after each of the three runs


def test_validate_predicts_a_case_again_at_the_probed_speed(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    config = EngineConfig(model=ModelConfig(model=str(model_dirs["tiny-llama"])), cache=CacheConfig(num_kv_blocks=256))
    shape = WorkloadShape(scale=0.05, tool_wait_s=0.05)
    profile = dataclasses.replace(load_profile("cpu-served"), probe_s=(1.0, 1.2, 0.8))
    case = validate_case(
        Case("mapreduce", 1),
        config,
        shape,
        2,
        4.0,
        0,
        profile,
        2,
        serve_and_measure(tiny_llama),
        readings(2.0, 3.0, 9.0),
    )
    # Read before the first run and after each: the median against the calibration's median.
    assert case["speed"]["readings_s"] == [2.0, 3.0, 9.0] and case["speed"]["ratio"] == 3.0
    programs = make_programs("mapreduce", 2, 4.0, 0, shape)
    cluster = ClusterConfig(instances=1)
    predicted = simulate(config, programs, profile, cluster)
    slower = simulate(config, programs, at_speed(profile, 3.0), cluster)
    avg, _, throughput = case["rows"]
    assert avg["predicted"] == predicted["avg_latency_s"] and avg["predicted_at_speed"] == slower["avg_latency_s"]
    assert (
        slower["avg_latency_s"] > predicted["avg_latency_s"]
        and throughput["predicted_at_speed"] < throughput["predicted"]
    )
    for row in case["rows"]:
        assert row["rel_error_at_speed"] == pytest.approx(
            (row["predicted_at_speed"] - row["measured"]) / row["measured"]
        )
    # A profile that kept no readings (one calibrated before the probe, or a GPU's) has no speed to scale to.
    plain = validate_case(
        Case("mapreduce", 1),
        config,
        shape,
        2,
        4.0,
        0,
        load_profile("h100"),
        1,
        serve_and_measure(tiny_llama),
        readings(),
    )
    assert plain["speed"] is None and all("predicted_at_speed" not in r for r in plain["rows"])
    assert statistics.median(case["speed"]["calibration_s"]) == 1.0
