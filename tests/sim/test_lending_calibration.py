"""Calibrating a KV-lending cluster (``simulate calibrate --served --kv-lending on``): the steps over lent blocks
stay out of the step model, and the network latency is set from the real round trips' waits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.bench.workloads import WorkloadShape, make_programs
from boundless.config import CacheConfig, ClusterConfig, EngineConfig
from boundless.engine.attention_time import AttentionSample, ChunkShape
from boundless.engine.lending_stats import LendingStats
from boundless.sim.calibrate import fit_lending_latency, latency_for_exposure, programs_error
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import FittedStepCost, load_profile, profile_from_dict
from boundless.sim.step_model import StepTimeModel, fit_step_model, local_steps, samples_from_json, samples_json
from boundless.sim.validate import simulate

PROFILE = Path(__file__).parents[2] / "boundless" / "sim" / "profiles" / "cpu-served-2inst-lending.json"


def _steps(model: StepTimeModel, remote_factor: float) -> list[AttentionSample]:
    """Steps of many shapes timed by ``model``; every third attends over lent tokens and takes ``remote_factor``
    times as long (its round trips' waits)."""
    steps = []
    for i in range(60):
        shapes = tuple(ChunkShape(16 * (i % 7) + 8 * j, 1 + (i % 5) * 16 * (j == 0)) for j in range(1 + i % 4))
        remote = 32 if i % 3 == 0 else 0
        seconds = model.predict(shapes) * (remote_factor if remote else 1.0)
        steps.append(AttentionSample(shapes, seconds, remote=remote))
    return steps


def test_steps_over_lent_blocks_stay_out_of_the_fit_and_its_errors() -> None:
    true = StepTimeModel(base_s=0.01, per_seq_s=0.002, per_row_s=0.0004, per_cached_s=2e-5)
    steps = _steps(true, remote_factor=3.0)
    assert len(local_steps(steps)) == 40
    fitted = fit_step_model(steps)
    # Fitted on the local steps alone, the model is the true one; the slow remote steps would have pulled it up.
    assert fitted.predict(steps[1].shapes) == pytest.approx(true.predict(steps[1].shapes), rel=1e-3)
    error = programs_error(fitted, steps)
    assert error.steps == 40 and error.ratio == pytest.approx(1.0, rel=1e-3)
    # The remote tokens survive a profile's JSON (a validate run's real steps too).
    assert [s.remote for s in samples_from_json(samples_json(steps))] == [s.remote for s in steps]


def test_a_latency_step_moves_by_half_the_missing_wait() -> None:
    assert latency_for_exposure(1e-3, 1.5e-3, 2.5e-3) == pytest.approx(1.5e-3)
    assert latency_for_exposure(1e-4, 2e-3, 1e-3) == 0.0  # never below zero


def _profile_with(network: LinkSpec) -> dict:
    data = json.loads(PROFILE.read_text())
    data["links"]["network"] = {"gbytes_per_s": network.bytes_per_s / 1e9, "latency_s": network.latency_s}
    return data


def test_the_latency_fit_finds_the_latency_a_run_was_simulated_at() -> None:
    # Half of validate's lending case (6 chat programs at 0.25/s on two 48-block pools; seed 0, which lends ~6,000
    # round trips, against ~31,000 and 6 s a run for the 12 of seed 5) simulated at a round trip of 1.5 ms each way
    # stands for the real run; the fit, started at 50 us, must find that latency again.
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=48))
    cluster = ClusterConfig(instances=2, kv_lending="on", lending_request_pools=1.6)
    runs = [make_programs("chat", 6, 0.25, 0, WorkloadShape())]
    truth = LinkSpec(5e9, 1.5e-3)
    assert isinstance(load_profile(str(PROFILE)).step, FittedStepCost)
    lent = simulate(config, runs[0], profile_from_dict(_profile_with(truth)), cluster)["lending"]
    assert lent["round_trips"] > 0
    measured = LendingStats(round_trips=int(lent["round_trips"]), exposed_wait_s=lent["exposed_wait_s"])
    fit = fit_lending_latency(measured, _profile_with, LinkSpec(5e9, 5e-5), runs, config, cluster)
    assert fit.network.latency_s == pytest.approx(truth.latency_s, rel=0.05)
    assert fit.simulated_per_round_trip_s == pytest.approx(fit.measured_per_round_trip_s, rel=0.05)
    assert fit.rounds <= 3 and fit.measured_round_trips == measured.round_trips


def test_calibrate_lends_only_on_a_served_cluster(model_dirs: dict[str, Path]) -> None:
    from boundless.cli import main

    args = ["simulate", "calibrate", "--model", str(model_dirs["tiny-llama"]), "--kv-lending", "on"]
    for flags in (["--served"], ["--instances", "2"], ["--served", "--roles", "1:1"]):
        with pytest.raises(SystemExit, match="--kv-lending on: needs --served"):
            main([*args, *flags])


@pytest.mark.slow
def test_calibrate_served_on_a_lending_cluster_writes_a_profile_with_its_knobs_and_measured_link(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from boundless.cli import main

    # 4 chat programs on 2 instances of 16 blocks (256 tokens), a request up to 1.5 pools: the conversations outgrow
    # their pool, so the granted calls borrow (room moves, model or not) and their steps attend over lent blocks.
    out = tmp_path / "lend.json"
    args = ["simulate", "calibrate", "--served", "--instances", "2", "--kv-lending", "on"]
    args += ["--model", str(model_dirs["tiny-llama"]), "--batch-sizes", "2", "--prompt-lens", "8,64"]
    args += ["--output-tokens", "3", "--repeats", "1", "--held-out-batch-sizes", "", "--num-kv-blocks", "16"]
    args += ["--workloads", "chat", "--num-programs", "4", "--rate", "1", "--lending-interval-s", "0.5"]
    args += ["--lending-min-gain", "0", "--lending-request-pools", "1.5"]
    assert main([*args, "--out", str(out), "--name", "lend"]) == 0
    data = json.loads(out.read_text())
    calibration = data["calibration"]
    knobs = calibration["kv_lending"]
    assert (calibration["instances"], knobs["lending_request_pools"], knobs["lending_min_gain"]) == (2, 1.5, 0.0)
    assert isinstance(load_profile(str(out)).step, FittedStepCost)
    fit = knobs["latency_fit"]
    assert fit is not None and fit["measured_round_trips"] > 0  # the link is the fitted one, and says so
    assert data["links"]["network"]["latency_s"] == pytest.approx(fit["network"]["latency_s"])
    assert "round trip" in data["sources"]["network"]
    samples = samples_from_json(calibration["samples"])
    assert any(s.remote for s in samples) and any(not s.remote for s in samples)
