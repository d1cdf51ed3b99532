"""The engine's host phases recorded over a real run, and laid against the GPU's idle gaps."""

from __future__ import annotations

import itertools

import pytest

from boundless.bench.host_phases import Phase, PhaseRecorder, gaps_by_phase, overlaps, split
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel


def test_the_recorder_sees_each_phase_of_each_step_and_puts_the_engine_back(tiny_llama: LoadedModel) -> None:
    """Every step of a run is decided, launched and applied once, in that order (``schedule_ahead`` asked after each
    launch, its result read), each with its shape (the prefill's tokens, the decodes); the engine's own methods are
    back after."""
    llm = LLM.from_config(engine_config(tiny_llama.name, max_num_batched_tokens=64), tiny_llama)
    core = llm.engine
    prompts = [[1 + i] * 40 for i in range(3)]  # 120 prompt tokens: two steps of prefill at 64 a step
    with PhaseRecorder(core) as phases:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    launches = [p for p in phases if p.name == "launch"]
    first_step = ["schedule", "launch", "schedule_ahead", "wait", "finish_step"]
    assert [p.name for p in phases][:5] == first_step
    shapes = [p.step for p in launches]
    assert shapes[:3] == ["64 prefill tokens", "56 prefill tokens, 1 decode", "3 decodes"]
    assert len(launches) == len([p for p in phases if p.name == "finish_step"]) == core.counters.steps
    assert all(p.start_ns <= p.end_ns for p in phases)
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(launches))
    assert "launch" not in core.__dict__ and "schedule" not in core.__dict__
    figures = split(phases, 1.0, core.counters.steps)
    assert figures["steps"] == core.counters.steps and 0 < figures["execute_s"] < 1.0
    assert figures["other_s"] == pytest.approx(
        1.0 - figures["schedule_s"] - figures["execute_s"] - figures["finish_step_s"]
    )


def test_overlaps_says_what_the_host_did_in_an_interval() -> None:
    """Each phase's share of an interval on the GPU's clock (the host's moved by the offset), nested phases each
    counted, and the rest as outside the engine's phases."""
    phases = [
        Phase("finish_step", 100, 400, "256 decodes x 16"),
        Phase("schedule", 400, 500),
        Phase("launch", 500, 2000, "16384 prefill tokens"),
        Phase("wait", 600, 700),
    ]
    ms = 1_000_000
    scaled = [Phase(p.name, p.start_ns * ms // 100, p.end_ns * ms // 100, p.step) for p in phases]
    got = overlaps(3 * ms + 7, 10 * ms + 7, scaled, offset_ns=7)  # [3 ms, 10 ms) on the host's clock
    assert got == {
        "launch (16384 prefill tokens)": 5.0,
        "finish_step (256 decodes x 16)": 1.0,
        "schedule": 1.0,
        "wait": 1.0,
    }
    assert overlaps(0, 3 * ms, scaled) == {"finish_step (256 decodes x 16)": 2.0, "outside the engine's phases": 1.0}


def test_gaps_by_phase_takes_the_longest_gaps_from_the_first_activity() -> None:
    ms = 1_000_000
    phases = [Phase("finish_step", 50 * ms, 60 * ms), Phase("schedule", 60 * ms, 62 * ms)]
    gaps = [(1 * ms, 10 * ms), (12 * ms, 50 * ms - 1000 * ms)]  # (ns idle, ns after the first activity at 1,000 ms)
    got = gaps_by_phase([(g, at + 1000 * ms) for g, at in gaps], 0, phases, offset_ns=0)
    assert got[0] == {"ms": 12.0, "at_ms": 50.0, "host": {"finish_step": 10.0, "schedule": 2.0}}
    assert got[1]["ms"] == 1.0 and got[1]["host"] == {"outside the engine's phases": 1.0}
    assert len(gaps_by_phase(gaps * 4, 0, phases, 0, limit=5)) == 5
