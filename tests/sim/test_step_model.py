"""The CPU-kernel step model: each step's contention from the engines' overlapping steps, the fit of every term
and of the contention factor from a known step function, and the simulator charging the contention."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from boundless.bench.workloads import WorkloadShape, make_programs
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig
from boundless.engine.attention_time import AttentionSample, ChunkShape
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import FittedStepCost
from boundless.sim.simulator import Simulator
from boundless.sim.step_model import TERMS, StepTimeModel, contention, fit_step_model, samples_from_json, samples_json

# Two engines of one thread each on a shared machine: a step takes 6 ms more while the other engine steps beside it.
KNOWN = StepTimeModel(
    base_s=0.02,
    per_seq_s=0.001,
    per_prefill_s=0.01,
    per_row_s=0.002,
    per_row_group_s=0.003,
    per_cached_s=1.5e-6,
    per_pair_s=1.2e-6,
    per_contention_s=0.006,
)

SHAPES = [
    *([ChunkShape(c, 1)] * n for n in (1, 2, 3, 5, 8) for c in (20, 300, 900)),
    *([ChunkShape(0, p)] * n for n in (1, 2) for p in (16, 90, 400)),
    [ChunkShape(64, 30), ChunkShape(200, 1)],
    [ChunkShape(512, 256)],
]


def two_engine_steps(seed: int = 0) -> list[AttentionSample]:
    """Steps of two engines, back to back: each shape once alone (engine A; B idle) and once with both engines
    running it at the same time, so each takes the contended step's time more; shuffled, as a take of both engines'
    records is."""
    now, steps = 100.0, []
    for shapes in SHAPES:
        alone = KNOWN.predict(shapes)
        now += alone
        steps.append(AttentionSample(tuple(shapes), alone, now))
        together = KNOWN.predict(shapes, contention=1.0)
        now += together
        steps += [AttentionSample(tuple(shapes), together, now)] * 2  # A's and B's, over the same span
    random.Random(seed).shuffle(steps)
    return steps


def test_a_steps_contention_is_the_share_of_it_other_engines_stepped_beside_it() -> None:
    a = AttentionSample((ChunkShape(0, 1),), 1.0, 11.0)  # 10-11
    b = AttentionSample((ChunkShape(0, 1),), 0.5, 11.25)  # 10.75-11.25: half of it beside a
    c = AttentionSample((ChunkShape(0, 1),), 1.0, 13.0)  # 12-13: alone
    assert contention([a, b, c], others=1) == [0.25, 0.5, 0.0]
    assert contention([a, b, c], others=2) == [0.125, 0.25, 0.0]  # a share of two other engines
    assert contention([AttentionSample(a.shapes, 1.0)], others=1) == [0.0]  # no end times: nothing known


def test_the_fit_recovers_every_term_with_the_contended_steps_time() -> None:
    steps = two_engine_steps()
    fitted = fit_step_model(steps, threads=1, others=1)
    for term in TERMS:
        assert getattr(fitted, term) == pytest.approx(getattr(KNOWN, term), rel=1e-3), term
    robust = fit_step_model(steps, threads=1, robust=True, outlier_factor=1.5, others=1)
    for term in TERMS:
        assert getattr(robust, term) == pytest.approx(getattr(KNOWN, term), rel=1e-3), term
    # Without the end times the contention is not seen: the other terms take it, on average.
    blind = fit_step_model([AttentionSample(s.shapes, s.seconds) for s in steps], threads=1, others=1)
    assert blind.per_contention_s == 0 and blind.base_s > 1.1 * KNOWN.base_s
    assert fit_step_model(steps, threads=1, others=1) == fitted  # deterministic


def test_measured_steps_keep_their_end_times_through_json() -> None:
    steps = two_engine_steps()
    rows = json.loads(json.dumps(samples_json(steps)))
    assert samples_from_json(rows) == steps and len(rows[0]) == 3
    assert len(samples_json([AttentionSample((ChunkShape(3, 1),), 0.1)])[0]) == 2  # none known: none written


def _busy(model: StepTimeModel, instances: int) -> tuple[float, list]:
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=400))
    programs = make_programs("mapreduce", 8, 2.0, 0, WorkloadShape(scale=0.1, tool_wait_s=0.2))
    sim = Simulator(
        config,
        SimulatedModel.read(ModelConfig()),
        FittedStepCost(model),
        instances=instances,
        cluster=ClusterConfig(instances=instances),
    )
    results = sim.run(programs)
    return sum(i.core.counters.busy_seconds for i in sim.instances.values()), [r.latency_s for r in results]


def test_the_simulator_slows_a_step_by_the_instances_stepping_beside_it() -> None:
    alone = dataclasses.replace(KNOWN, per_contention_s=0.0)
    busy_alone, _ = _busy(alone, 2)
    busy_contended, latencies = _busy(KNOWN, 2)
    # Two instances often step together: a step costs up to 6 ms more, the busy seconds are between the two.
    assert busy_alone * 1.03 < busy_contended < busy_alone * 1.4
    assert _busy(KNOWN, 2) == (busy_contended, latencies)  # deterministic
    assert _busy(KNOWN, 1) == _busy(alone, 1)  # one instance has no one beside it


# A served engine's step: KNOWN's shape terms, and the server's work on the requests that arrived and left beside it.
SERVED = dataclasses.replace(KNOWN, per_contention_s=0.0, per_departure_s=0.004)


def _simulated_steps(model: StepTimeModel, workload: str = "mapreduce", seed: int = 0) -> tuple[list, float]:
    """The steps a simulated engine (the real scheduler and engine core) recorded over a workload, and its busy
    seconds."""
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=400))
    programs = make_programs(workload, 8, 1.0, seed, WorkloadShape(scale=0.1, tool_wait_s=0.2))
    sim = Simulator(config, SimulatedModel.read(ModelConfig()), FittedStepCost(model), instances=1)
    sim.run(programs)
    core = next(iter(sim.instances.values())).core
    return list(core.step_times.samples), core.counters.busy_seconds


def test_the_fit_recovers_the_servers_departures_from_a_workloads_steps() -> None:
    # The simulated engine records each step with the requests that entered and left before it, as the real one
    # does (EngineCore.finish_step): over a workload, calls leave while others stay.
    steps, _ = _simulated_steps(SERVED)
    assert sum(s.departures for s in steps) > 10
    # Every call arrives once, counted at the step that admits it (its prefill's: per_prefill_s is its term).
    calls = sum(p.num_calls for p in make_programs("mapreduce", 8, 1.0, 0, WorkloadShape(scale=0.1, tool_wait_s=0.2)))
    assert sum(s.arrivals for s in steps) == calls
    assert all(any(c.new > 1 for c in s.shapes) for s in steps if s.arrivals)
    for robust in (False, True):
        fitted = fit_step_model(steps, threads=1, robust=robust, outlier_factor=1.5)
        for term in TERMS:
            assert getattr(fitted, term) == pytest.approx(getattr(SERVED, term), rel=1e-3, abs=1e-12), term
    # Without the term the shape terms cannot take the server's work: some steps are missed by over 10%.
    blind = fit_step_model(steps, threads=1, terms=[t for t in TERMS if t != "per_departure_s"])
    assert max(abs(blind.predict_sample(s) / s.seconds - 1) for s in steps) > 0.1


def test_the_simulator_charges_each_step_its_departures() -> None:
    shapes_only = dataclasses.replace(SERVED, per_departure_s=0.0)
    steps, busy = _simulated_steps(SERVED)
    # Every simulated step took the model's time for its shapes and the requests that left at the step before.
    assert all(s.seconds == pytest.approx(SERVED.predict_sample(s)) for s in steps)
    assert sum(s.departures for s in steps) * SERVED.per_departure_s > 0.05
    _, busy_shapes_only = _simulated_steps(shapes_only)
    assert busy > busy_shapes_only  # the server's work costs the engine time
    assert _simulated_steps(SERVED) == (steps, busy)  # deterministic


def test_steps_keep_their_arrivals_and_departures_through_json() -> None:
    steps = [AttentionSample((ChunkShape(30, 1), ChunkShape(0, 40)), 0.05, 12.5, 1, 2)]
    rows = json.loads(json.dumps(samples_json(steps)))
    assert rows == [[[[30, 1], [0, 40]], 0.05, 12.5, 1, 2]] and samples_from_json(rows) == steps
