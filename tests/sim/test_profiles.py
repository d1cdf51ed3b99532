"""Hardware profiles: the calibration fit recovers a known step model, and every shipped profile loads with
its sources and orders the GPUs as their published figures do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import AttentionTimeModel, ChunkShape
from boundless.model.loader import LoadedModel
from boundless.sim.calibrate import CalibrationGrid, calibrate, fit_step_model, median_rel_error, run_grid
from boundless.sim.engine import SimulatedModel, simulated_engine
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import (
    FittedStepCost,
    RooflineStepCost,
    fitted_profile_dict,
    load_profile,
    profile_from_dict,
    profile_names,
)
from boundless.sim.simulator import VirtualClock

KNOWN = AttentionTimeModel(base_s=0.03, per_seq_s=0.002, per_token_s=0.0015, per_cached_s=2e-6, per_pair_s=3e-9)


def test_the_calibration_grid_and_fit_recover_a_known_step_model() -> None:
    # The real engine on the calibration grid, whose steps take exactly KNOWN's time: the fit must find KNOWN.
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=600), scheduler=SchedulerConfig(max_num_batched_tokens=512))
    core = simulated_engine(config, SimulatedModel.read(ModelConfig()), FittedStepCost(KNOWN), VirtualClock())
    samples = run_grid(core, CalibrationGrid((1, 3, 8), (16, 128, 600), output_tokens=4))
    assert len({len(s.shapes) for s in samples}) >= 3 and any(c.cached and c.new > 1 for s in samples for c in s.shapes)
    fitted = fit_step_model(samples)
    for name, value in vars(KNOWN).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-3), name
    assert median_rel_error(fitted, samples) < 1e-6


def test_calibrate_fits_the_real_engine(tiny_llama: LoadedModel) -> None:
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    result = calibrate(tiny_llama, config, CalibrationGrid((1, 4), (8, 64), output_tokens=3))
    assert len(result.samples) >= 4 * 3
    assert result.model.predict([ChunkShape(0, 64)] * 4) > result.model.predict([ChunkShape(8, 1)])


def test_a_fitted_profile_round_trips_through_json(tmp_path: Path) -> None:
    links = {
        k: LinkSpec(1e9 * (i + 1), 1e-4)
        for i, k in enumerate(("host_copy", "storage_read", "storage_write", "network"))
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(fitted_profile_dict("mine", "a test", KNOWN, links, {"step": "made up"})))
    profile = load_profile(str(path))
    assert isinstance(profile.step, FittedStepCost) and profile.step.model == KNOWN
    assert profile.storage_write == links["storage_write"] and profile.disk_cost.write_bytes_per_s == 3e9


def test_shipped_profiles_load_with_their_sources() -> None:
    assert {"a100-80gb", "h100", "h200"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name and profile.host_copy.bytes_per_s > 0
        if isinstance(profile.step, RooflineStepCost):
            for figure in ("peak_bf16_tflops", "hbm_tbytes_per_s", "host_copy", "network", "storage"):
                assert "datasheet" in profile.sources[figure] or "DGX" in profile.sources[figure], (name, figure)
    with pytest.raises(ValueError, match="h100"):
        load_profile("no-such-gpu")


def test_roofline_profiles_order_the_gpus_as_their_figures() -> None:
    a100, h100, h200 = (load_profile(n).step for n in ("a100-80gb", "h100", "h200"))
    assert isinstance(a100, RooflineStepCost)
    decode = [ChunkShape(2000, 1)] * 8  # memory-bound: weights and KV reads
    prefill = [ChunkShape(0, 4096)]  # compute-bound
    assert a100.predict(decode) > h100.predict(decode) > h200.predict(decode)  # 2.0 < 3.35 < 4.8 TB/s
    assert h100.predict(prefill) == pytest.approx(h200.predict(prefill))  # the same 989 TFLOP/s
    assert a100.predict(prefill) / h100.predict(prefill) == pytest.approx(989 / 312, rel=0.05)
    # A longer context costs more in both regimes.
    assert h100.predict([ChunkShape(8000, 1)] * 8) > h100.predict(decode)
    assert h100.predict([ChunkShape(8000, 4096)]) > h100.predict(prefill)
    data = json.loads((Path(__file__).parents[2] / "boundless/sim/profiles/h100.json").read_text())
    assert profile_from_dict(data).step == h100


def test_validate_reports_each_metric_with_its_relative_error() -> None:
    from boundless.sim.simulator import SimResult
    from boundless.sim.validate import compare, simulated_summary

    predicted = simulated_summary([SimResult("a", 0.0, 2.0, 5), SimResult("b", 1.0, 5.0, 5)])
    assert predicted["avg_latency_s"] == 3.0 and predicted["throughput_programs_per_s"] == 2 / 5.0
    rows = compare(predicted, {"avg_latency_s": 4.0, "p95_latency_s": 4.0, "throughput_programs_per_s": 0.4})
    assert [r["metric"] for r in rows] == ["avg_latency_s", "p95_latency_s", "throughput_programs_per_s"]
    assert rows[0]["rel_error"] == pytest.approx(-0.25) and rows[2]["rel_error"] == pytest.approx(0.0)


@pytest.mark.slow
def test_validate_runs_the_real_engine_beside_the_simulator(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from boundless.cli import main

    out = tmp_path / "v.json"
    args = ["simulate", "validate", "--model", str(model_dirs["tiny-llama"]), "--num-programs", "3", "--rate", "1"]
    assert main([*args, "--profile", "h100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(r["measured"] > 0 and r["predicted"] > 0 for r in rows)
