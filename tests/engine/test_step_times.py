"""The engine records each step's batch, tokens, attention and seconds, and those samples determine the
step-time model the lending planner uses: run the real EngineCore on a cost model whose coefficients are known,
and the fit of its recorded steps gives them back."""

from __future__ import annotations

from pathlib import Path

import pytest

from boundless.cluster.perf_model import StepTimeModel, fit_step_time_model
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.engine.step_times import StepSample, StepTimeRecorder, step_sample
from boundless.sim.engine import SimulatedModel, simulated_engine
from boundless.sim.simulator import VirtualClock

PARAMS = SamplingParams(max_tokens=4)


def chunk(request_id: str, start_pos: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(request_id, [7] * num_tokens, start_pos, [], True, PARAMS, 0, ())


def test_a_sample_counts_the_positions_each_token_attends_over() -> None:
    sched = SchedulerOutput(chunks=[chunk("decode", 99, 1), chunk("prefill", 10, 4)])
    sample = step_sample(sched, 0.25)
    # The decode attends over 100 positions; the chunk's tokens over 11, 12, 13 and 14.
    assert sample == StepSample(batch_size=2, num_tokens=5, attended_tokens=100 + 11 + 12 + 13 + 14, seconds=0.25)
    assert sample.prefill_tokens == 3


def test_the_recorder_keeps_the_latest_and_drains_each_sample_once() -> None:
    recorder = StepTimeRecorder(capacity=3)
    samples = [StepSample(1, 1, i, 0.1) for i in range(5)]
    recorder.record(samples[0])
    assert recorder.drain() == samples[:1]
    for s in samples[1:]:
        recorder.record(s)
    assert recorder.samples() == samples[2:]  # the oldest fell out
    assert recorder.drain() == samples[2:]  # samples[1] was lost before any drain took it
    assert recorder.drain() == [] and recorder.num_recorded == 5


@pytest.fixture(scope="module")
def tiny_config(model_dirs: dict[str, Path]) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=str(model_dirs["tiny-llama"]), max_model_len=256),
        CacheConfig(num_kv_blocks=128, block_size=16),
        SchedulerConfig(policy="fcfs", max_num_batched_tokens=64),
    )


def test_a_fit_of_the_engines_own_steps_recovers_its_step_time(tiny_config: EngineConfig) -> None:
    true = StepTimeModel(base_s=0.02, per_seq_s=0.003, per_prefill_token_s=0.001, per_attended_s=2e-5)
    core = simulated_engine(tiny_config, SimulatedModel.read(tiny_config.model), true, VirtualClock())
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
    samples = core.step_times.samples()
    assert len(samples) == core.counters.steps
    assert len({s.batch_size for s in samples}) >= 4
    assert any(s.prefill_tokens > 0 for s in samples) and any(s.prefill_tokens == 0 for s in samples)
    fitted = fit_step_time_model(samples)
    assert fitted.coefficients == pytest.approx(true.coefficients, rel=1e-6)
