"""The engine records every step's shapes and seconds, and those samples determine the step-time model the
lending planner uses: run the real EngineCore on a cost model whose coefficients are known, and the fit of its
recorded steps gives them back."""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import pytest

from boundless.cluster.perf_model import fit_step_time_model
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import (
    HEARTBEAT_READER,
    AttentionSample,
    AttentionTimeModel,
    AttentionTimeRecorder,
    ChunkShape,
    shapes_of,
)
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.sim.engine import SimulatedModel, simulated_engine
from boundless.sim.simulator import VirtualClock


def test_the_recorder_drains_each_sample_once() -> None:
    recorder = AttentionTimeRecorder(capacity=3)
    steps = [[ChunkShape(i, 1)] for i in range(5)]
    recorder.record(steps[0], 0.1)
    assert [s.shapes for s in recorder.drain()] == [tuple(steps[0])]
    for shapes in steps[1:]:
        recorder.record(shapes, 0.1)
    # Steps 2-4 are held (1 aged out before any drain took it); the drain hands over those.
    assert [s.shapes[0].cached for s in recorder.drain()] == [2, 3, 4]
    assert recorder.drain() == []
    recorder.record(steps[0], 0.1)
    assert [s.shapes[0].cached for s in recorder.drain()] == [0]
    assert len(recorder.samples) == 3  # a drain takes nothing away from the engine's own fit


def test_each_reader_drains_every_sample_once_whatever_the_others_took() -> None:
    # KV lending's heartbeats and a calibration take the same engine's steps: neither may take the other's.
    recorder = AttentionTimeRecorder(capacity=4)
    for i in range(3):
        recorder.record([ChunkShape(i, 1)], 0.1, remote=8 * (i == 1))
    assert [(s.shapes[0].cached, s.remote) for s in recorder.drain(HEARTBEAT_READER)] == [(0, 0), (1, 8), (2, 0)]
    recorder.record([ChunkShape(3, 1)], 0.1)
    assert [s.shapes[0].cached for s in recorder.drain()] == [0, 1, 2, 3]
    assert [s.shapes[0].cached for s in recorder.drain(HEARTBEAT_READER)] == [3]
    for i in range(4, 10):
        recorder.record([ChunkShape(i, 1)], 0.1)
    # 6 new, 4 held: each reader gets the 4 the recorder still holds.
    assert [s.shapes[0].cached for s in recorder.drain()] == [6, 7, 8, 9]
    assert [s.shapes[0].cached for s in recorder.drain(HEARTBEAT_READER)] == [6, 7, 8, 9]
    assert recorder.drain() == recorder.drain(HEARTBEAT_READER) == []


class EagerRecorder:
    """What the recorder keeps, made at once: every pass a sample, appended to a deque of ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.samples: deque[AttentionSample] = deque(maxlen=capacity)
        self.undrained = 0

    def append(self, sample: AttentionSample) -> None:
        self.samples.append(sample)
        self.undrained = min(self.undrained + 1, len(self.samples))

    def drain(self) -> list[AttentionSample]:
        new = list(self.samples)[len(self.samples) - self.undrained :]
        self.undrained = 0
        return new


@pytest.mark.parametrize("seed", range(6))
def test_the_recorder_makes_what_recording_each_pass_at_once_would(seed: int) -> None:
    """The recorder makes its samples when read; over random steps, windows (some passes without shapes), drains and
    reads, what it returns is what making each pass's sample when recorded gives, to the bit (ended_at included)."""
    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 8, 40])
    lazy, eager = AttentionTimeRecorder(capacity=capacity), EagerRecorder(capacity)
    now = 0.0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            shapes = [ChunkShape(rng.randrange(100), rng.randrange(1, 9)) for _ in range(rng.randrange(3))]
            now += rng.random()
            seconds, events = rng.random(), (rng.randrange(3), rng.randrange(3))
            lazy.record(shapes, seconds, now, *events)
            if shapes:
                eager.append(AttentionSample(tuple(shapes), seconds, now, *events))
        elif op < 0.8:
            passes = [
                tuple(ChunkShape(rng.randrange(100) + j, 1) for _ in range(rng.choice([0, 1, 1, 2])))
                for j in range(rng.randrange(1, 12))
            ]
            seconds = [rng.random() / 7 for _ in passes]
            now += sum(seconds)
            events = (rng.randrange(3), rng.randrange(3))
            lazy.record_window(passes, seconds, now, *events)
            for j, shapes in enumerate(passes):
                if shapes:
                    ended = now - sum(seconds[j + 1 :])
                    eager.append(AttentionSample(shapes, seconds[j], ended, *(events if j == 0 else (0, 0))))
        elif op < 0.9:
            assert lazy.drain() == eager.drain()
        else:
            assert list(lazy.samples) == list(eager.samples)
    assert list(lazy.samples) == list(eager.samples)
    assert lazy.drain() == eager.drain()


class KnownCost:
    """A simulated step costs what ``model`` predicts for its shapes."""

    def __init__(self, model: AttentionTimeModel) -> None:
        self.model = model

    def step_time(self, sched: SchedulerOutput) -> float:
        return self.model.predict(shapes_of(sched))


@pytest.fixture(scope="module")
def tiny_config(model_dirs: dict[str, Path]) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=str(model_dirs["tiny-llama"]), max_model_len=256),
        CacheConfig(num_kv_blocks=128, block_size=16),
        SchedulerConfig(policy="fcfs", max_num_batched_tokens=64),
    )


def test_a_fit_of_the_engines_own_steps_recovers_its_step_time(tiny_config: EngineConfig) -> None:
    true = AttentionTimeModel(base_s=0.02, per_seq_s=0.002, per_token_s=0.001, per_pair_s=2e-5)
    core = simulated_engine(tiny_config, SimulatedModel.read(tiny_config.model), KnownCost(true), VirtualClock())
    # Requests of several lengths arriving in waves: steps of different batches, contexts and prefill chunks.
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for wave in range(3):
        for i in range(2 + 2 * wave):
            length = 20 + 37 * i + 11 * wave
            core.add_request(f"w{wave}-{i}", list(range(10, 10 + length)), params)
        for _ in range(6):
            core.step()
    while core.has_unfinished():
        core.step()
    samples = core.step_times.drain()
    assert len(samples) == core.counters.steps
    assert len({len(s.shapes) for s in samples}) >= 4
    assert any(c.new > 1 for s in samples for c in s.shapes)  # prefill chunks
    assert any(all(c.new == 1 for c in s.shapes) for s in samples)  # steps of decodes only
    fitted = fit_step_time_model(samples)
    for name in ("base_s", "per_seq_s", "per_token_s", "per_pair_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6)
