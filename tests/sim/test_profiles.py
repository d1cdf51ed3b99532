"""Hardware profiles: the calibration fit recovers a known step model, and every shipped profile loads with
its sources and orders the GPUs as their published figures do."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path

import pytest

from boundless.bench.workloads import WorkloadShape, make_programs
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import (
    AttentionSample,
    AttentionTimeModel,
    ChunkShape,
    shapes_of,
)
from boundless.engine.multi_step import WindowPasses
from boundless.engine.scheduler import SchedulerOutput
from boundless.model.loader import LoadedModel
from boundless.sim.calibrate import (
    FitSpec,
    calibrate,
    calibrate_served,
    calibration_programs,
    fit_profile_model,
    fitted,
    median_rel_error,
    profile_json,
    program_run_ratios,
    programs_error,
    same_shape_ratios,
    with_program_runs,
)
from boundless.sim.cost import StepCost
from boundless.sim.engine import SimulatedModel, simulated_engine
from boundless.sim.grid import CalibrationGrid, fastest_per_shape, median_per_shape, run_grid, step_shape
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import (
    PROFILE_DIR,
    FittedStepCost,
    RooflineStepCost,
    fitted_profile_dict,
    load_profile,
    profile_from_dict,
    profile_names,
    with_tensor_parallel,
)
from boundless.sim.simulator import VirtualClock
from boundless.sim.step_model import TERMS, StepTimeModel, matmul_rows, samples_from_json, samples_json

# A step function of every kind the fit knows: the engine on two threads, with a micro-kernel term.
KNOWN = StepTimeModel(
    base_s=0.03, per_seq_s=0.002, per_row_s=0.0015, per_row_group_s=0.004, per_cached_s=2e-6, per_pair_s=3e-9, threads=2
)
TWO_THREADS = FitSpec(threads=2)
KNOWN_TERMS = {t: getattr(KNOWN, t) for t in TERMS if getattr(KNOWN, t)}


class ContendedStepCost:
    """KNOWN's time, but half the steps slowed at random, as another process on the cores slows them: by 5-45%
    (too little for the fit's outlier cut, so they bias a single pass) or by 2-10x."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def step_time(self, sched: SchedulerOutput) -> float:
        if self.rng.random() < 0.5:
            return KNOWN.predict(shapes_of(sched))
        slowdown = self.rng.uniform(1.05, 1.45) if self.rng.random() < 0.5 else self.rng.uniform(2.0, 10.0)
        return KNOWN.predict(shapes_of(sched)) * slowdown


def _grid_samples(cost: StepCost, repeats: int) -> list[AttentionSample]:
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=600), scheduler=SchedulerConfig(max_num_batched_tokens=512))
    core = simulated_engine(config, SimulatedModel.read(ModelConfig()), cost, VirtualClock())
    return run_grid(core, CalibrationGrid((1, 3, 8), (16, 128, 600), output_tokens=4, repeats=repeats))


def test_the_calibration_grid_and_fit_recover_a_known_step_model() -> None:
    # The real engine on the calibration grid, whose steps take exactly KNOWN's time: the fit must find KNOWN.
    samples = _grid_samples(FittedStepCost(KNOWN), repeats=1)
    assert len({len(s.shapes) for s in samples}) >= 3 and any(c.cached and c.new > 1 for s in samples for c in s.shapes)
    fitted = fit_profile_model(samples, TWO_THREADS)
    for name, value in KNOWN_TERMS.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-3), name
    assert median_rel_error(fitted, samples) < 1e-6
    # The engine's linear form cannot follow the matmuls' uneven split over two threads (a 512-token chunk is
    # blocks of 192, 192 and 128: one thread takes 288 rows' work) nor the 4-row groups: it misses some steps.
    linear = fit_profile_model(samples, FitSpec("linear"))
    assert max(abs(linear.predict(s.shapes) / s.seconds - 1) for s in samples) > 0.05


def test_the_fastest_of_repeated_shapes_recovers_the_model_under_contention() -> None:
    # Every repeat runs the same step shapes; contention slows half the steps. The fastest of each shape's
    # repeats (and dropping the shapes slowed in every repeat) finds KNOWN; one pass cannot.
    samples = _grid_samples(ContendedStepCost(), repeats=8)
    one_pass = _grid_samples(FittedStepCost(KNOWN), repeats=1)
    assert [step_shape(s) for s in samples] == [step_shape(s) for s in one_pass] * 8  # the same steps each repeat
    fitted = fit_profile_model(samples, TWO_THREADS)
    for name, value in KNOWN_TERMS.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-3), name
    first = fit_profile_model(samples[: len(one_pass)], TWO_THREADS)
    assert max(abs(getattr(first, n) / v - 1) for n, v in KNOWN_TERMS.items()) > 0.05


def test_calibrate_fits_the_real_engine(tiny_llama: LoadedModel) -> None:
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    grid = CalibrationGrid((1, 4), (8, 64), output_tokens=3, repeats=2)
    result = calibrate(tiny_llama, config, grid, held_out=CalibrationGrid((2,), (32,), output_tokens=3, repeats=2))
    assert len(result.samples) == 2 * len(fastest_per_shape(result.samples)) >= 2 * 4 * 3
    assert result.model.predict([ChunkShape(0, 64)] * 4) > result.model.predict([ChunkShape(8, 1)])
    held = {step_shape(s) for s in result.held_out}
    assert result.held_out_error is not None and result.held_out_error.steps == len(held) >= 3
    assert not held & {step_shape(s) for s in result.samples}  # the held-out shapes are not fitted
    assert 0 <= result.held_out_error.median <= result.held_out_error.p90 <= result.held_out_error.worst


class ServedStepCost:
    """KNOWN's time as a served engine runs it: every step slowed by the serving sharing the cores, by 20-60% at
    random in every pass (typically 40%), and a fifth of the steps also by outside load (2-10x)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def step_time(self, sched: SchedulerOutput) -> float:
        seconds = KNOWN.predict(shapes_of(sched)) * self.rng.uniform(1.2, 1.6)
        return seconds * self.rng.uniform(2.0, 10.0) if self.rng.random() < 0.2 else seconds


def test_a_served_fit_recovers_what_serving_adds_and_the_fastest_does_not() -> None:
    # The serving's share of a step is in every pass, so the median of a shape's passes keeps it (and drops the
    # outside bursts, which lift it by under 4% here); so does the least-absolute fit on every step, which needs no
    # shape twice. The fastest keeps only the luckiest pass, 20% under.
    samples = _grid_samples(ServedStepCost(), repeats=9)
    typical = StepTimeModel.from_coefficients([1.4 * c for c in KNOWN.coefficients], threads=2)
    probe = [[ChunkShape(0, 128)], [ChunkShape(300, 1)] * 8, [ChunkShape(64, 1)], [ChunkShape(0, 256)]]
    fastest = fit_profile_model(samples, TWO_THREADS)
    for per_shape in ("median", "all"):
        served = fit_profile_model(samples, FitSpec(per_shape=per_shape, threads=2))
        for shapes in probe:
            assert served.predict(shapes) == pytest.approx(typical.predict(shapes), rel=0.06), per_shape
    for shapes in probe:
        assert fastest.predict(shapes) < 0.9 * typical.predict(shapes)
    assert [s.shapes for s in median_per_shape(samples)] == [s.shapes for s in fastest_per_shape(samples)]


def test_a_step_of_two_blocks_takes_its_larger_block_on_each_of_two_threads() -> None:
    # The packed matmuls share (block of 192 rows, panel) pairs between threads in equal contiguous shares.
    assert [matmul_rows(t, 1) for t in (1, 128, 256, 512)] == [1, 128, 256, 512]  # one thread: every row
    assert matmul_rows(192, 2) == 192  # one block: each thread takes half the panels, every row
    assert matmul_rows(256, 2) == 2 * 192  # blocks of 192 and 64: one thread takes the 192
    assert matmul_rows(384, 2) == 384  # two full blocks: even
    assert matmul_rows(512, 2) == 2 * (192 + 96)  # 192, 192, 128: one thread takes one and a half blocks
    groups = [StepTimeModel(per_row_group_s=1.0).predict([ChunkShape(9, 1)] * n) for n in (1, 4, 5, 8, 9)]
    assert groups == [1, 1, 2, 2, 3]  # the micro-kernel's passes, 4 rows each


def test_a_linear_profile_loads_as_the_engines_own_model() -> None:
    linear = AttentionTimeModel(base_s=0.03, per_seq_s=0.002, per_token_s=0.0015, per_cached_s=2e-6, per_pair_s=3e-9)
    model = StepTimeModel.from_json(dataclasses.asdict(linear), threads=2)  # an earlier profile's coefficients
    for shapes in ([ChunkShape(0, 512)], [ChunkShape(300, 1)] * 6, [ChunkShape(0, 100), ChunkShape(40, 1)]):
        assert model.predict(shapes) == pytest.approx(linear.predict(shapes), rel=1e-12)


def test_the_same_shape_ratio_by_class_is_the_real_steps_over_the_models() -> None:
    steps = [
        AttentionSample((ChunkShape(100, 1),) * 3, 1.2 * KNOWN.predict([ChunkShape(100, 1)] * 3)),
        AttentionSample((ChunkShape(0, 300),), 0.9 * KNOWN.predict([ChunkShape(0, 300)])),
    ]
    ratios = same_shape_ratios(KNOWN, steps)
    assert ratios["decode x3"] == (1, pytest.approx(1.2)) and ratios["prefill >192 tok"] == (1, pytest.approx(0.9))
    assert ratios["all"][0] == 2 and 0.9 < ratios["all"][1] < 1.2
    assert "after a departure" not in ratios
    # A step after a departure is also counted on its own, against the model with its departure term.
    after = AttentionSample((ChunkShape(100, 1),) * 2, 1.1 * KNOWN.predict([ChunkShape(100, 1)] * 2), 5.0, 0, 1)
    assert same_shape_ratios(KNOWN, [*steps, after])["after a departure"] == (1, pytest.approx(1.1))


def test_calibrate_served_fits_the_steps_a_served_engine_ran(tiny_llama: LoadedModel) -> None:
    # The grid through the HTTP server and the openai client: the engine's own step records come back, fitted.
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    grid = CalibrationGrid((1, 4), (8, 64), output_tokens=3, repeats=2)
    held_out = CalibrationGrid((2,), (32,), output_tokens=3, repeats=3)
    arrivals = CalibrationGrid((3,), (20,), 3, 1, arrival_gap_s=0.05, shared_prefix=32)
    held_arrivals = CalibrationGrid((2,), (10,), 3, 1, arrival_gap_s=0.05, shared_prefix=32)
    result = calibrate_served(tiny_llama, config, grid, held_out, arrivals=(arrivals, held_arrivals))
    assert (result.fit.form, result.fit.per_shape) == ("cpu-kernels", "all")  # every step, least absolute error
    # Every request's prefill and its 2 decodes after it, in some batching: all its tokens were computed.
    computed = sum(c.new for s in result.samples for c in s.shapes)
    cells = 2 * sum(b * (p + 2) for b in grid.batch_sizes for p in grid.prompt_lens)
    # The arrivals: the first request computes the shared prefix, the later ones append to it once it is cached
    # (a request may come before the first's prefill ended: then it computes the prefix too).
    assert 3 * (20 + 2) + 32 <= computed - cells <= 3 * (20 + 2 + 32)
    appended = [c for s in result.samples for c in s.shapes if c.cached >= 32 and c.new > 1]
    assert appended, "no request appended to the cell's cached prefix"
    assert max(len(s.shapes) for s in result.samples) >= 2  # a cell's requests shared steps
    assert result.model.predict([ChunkShape(0, 64)] * 4) > result.model.predict([ChunkShape(8, 1)])
    held_computed = sum(c.new for s in result.held_out for c in s.shapes)
    assert result.held_out_error is not None and 3 * 2 * 34 + 2 * 12 + 32 <= held_computed <= 3 * 2 * 34 + 2 * 44


def test_a_served_fit_is_set_at_its_fitted_program_runs_level() -> None:
    # The fit is each step's median, below the programs' total where their steps' times are skewed (here: whole runs
    # slower than the grid): the model is scaled to the fitted runs' median level, the held-out runs measured at it.
    grid = _grid_samples(FittedStepCost(KNOWN), repeats=2)
    runs = [[dataclasses.replace(s, seconds=s.seconds * f) for s in grid[:20]] for f in (1.3, 1.1, 1.2)]
    result = fitted(grid + [s for run in runs for s in run], [], 0.0, FitSpec("cpu-kernels", "all", 2))
    assert programs_error(result.model, runs[2]).ratio > 1.15  # the grid-led fit: 1.2x programs are 1.2x it
    held = [dataclasses.replace(s, seconds=s.seconds * 1.2) for s in grid[20:40]]
    leveled = with_program_runs(result, [len(run) for run in runs], [held])
    assert leveled.program_level == statistics.median(programs_error(result.model, run).ratio for run in runs)
    assert leveled.model == result.model.scaled(leveled.program_level)
    fitted_ratios, _ = program_run_ratios(leveled)
    assert statistics.median(fitted_ratios) == pytest.approx(1.0)
    assert leveled.held_out_programs_error is not None
    assert leveled.held_out_programs_error.ratio == pytest.approx(1.0, abs=0.02)  # held-out programs at their level
    assert with_program_runs(result, [], [held]).model == result.model  # no program runs: the fit as it is


def test_calibration_programs_are_a_run_per_workload_of_other_seeds_than_validates() -> None:
    import argparse

    args = argparse.Namespace(
        workloads="chat,mapreduce",
        workload_seed=101,
        num_programs=3,
        rate=0.25,
        scale=0.1,
        tool_wait=0.2,
        program_runs=1,
    )
    fitted_runs, held_runs = calibration_programs(args)
    shape = WorkloadShape(scale=0.1, tool_wait_s=0.2)
    assert fitted_runs == [make_programs(w, 3, 0.25, 101, shape) for w in ("chat", "mapreduce")]
    assert held_runs == [make_programs(w, 3, 0.25, 102, shape) for w in ("chat", "mapreduce")]
    validated = {p.program_id for w in ("chat", "mapreduce") for p in make_programs(w, 3, 0.25, 0, shape)}
    assert validated.isdisjoint(p.program_id for run in fitted_runs + held_runs for p in run)
    # Several fitted runs (each served on a fresh engine): consecutive seeds, the held-out run's seed after them.
    fitted_runs, held_runs = calibration_programs(argparse.Namespace(**{**vars(args), "program_runs": 2}))
    assert fitted_runs == [make_programs(w, 3, 0.25, s, shape) for s in (101, 102) for w in ("chat", "mapreduce")]
    assert held_runs == [make_programs(w, 3, 0.25, 103, shape) for w in ("chat", "mapreduce")]
    with pytest.raises(SystemExit):
        calibration_programs(argparse.Namespace(**{**vars(args), "workloads": "chat,nope"}))


@pytest.mark.slow  # (6 s; a served engine's steps are fitted in the test above)
def test_calibrate_served_fits_served_programs_steps_and_holds_out_others(tiny_llama: LoadedModel) -> None:
    # calibrate --served --workloads: programs through the same server, their steps fitted with the grid's, and other
    # programs' steps held out and measured against the fit.
    config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    grid = CalibrationGrid((1, 3), (8, 40), output_tokens=3, repeats=1)
    shape = WorkloadShape(scale=0.05, tool_wait_s=0.05)
    fitted_runs = [make_programs("mapreduce", 2, 4.0, 101, shape)]
    held_runs = [make_programs("mapreduce", 2, 4.0, 102, shape)]
    result = calibrate_served(tiny_llama, config, grid, arrivals=None, programs=(fitted_runs, held_runs))
    # Every grid request and program call arrived once, and some calls left while others ran on (the grid's cells
    # leave together): the server's work beside a step.
    requests = sum(b for b in grid.batch_sizes for _ in grid.prompt_lens) + sum(p.num_calls for p in fitted_runs[0])
    assert sum(s.arrivals for s in result.samples) == requests and sum(s.departures for s in result.samples) > 0
    held = result.held_out_programs
    assert sum(s.arrivals for s in held) == sum(p.num_calls for p in held_runs[0])
    error = result.held_out_programs_error
    assert error is not None and error.steps == len(held) and error.ratio > 0 and error.median >= 0


@pytest.mark.slow  # (6 s; the served calibration's fit is checked in the fast suite above)
def test_calibrate_served_serves_each_program_run_on_a_fresh_engine_with_validates_flags(
    tiny_llama: LoadedModel,
) -> None:
    # Validate serves each repeat on a fresh engine, so the calibration's program runs are too: the same programs run
    # again find nothing of the first run cached (one engine for both would hit the first call's prompt blocks).
    grid_config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=64))
    programs_config = EngineConfig(model=ModelConfig(), cache=CacheConfig(num_kv_blocks=512))
    grid = CalibrationGrid((1,), (8,), output_tokens=3, repeats=1)
    run = make_programs("mapreduce", 2, 4.0, 101, WorkloadShape(scale=0.05, tool_wait_s=0.05))
    result = calibrate_served(
        tiny_llama, grid_config, grid, arrivals=None, programs=([run], [run]), programs_config=programs_config
    )
    first = result.held_out_programs[0]  # the second run's first step: its first call's prefill
    assert first.arrivals >= 1 and first.shapes[0].new >= 2 * 16  # two full blocks a reused engine would have cached
    # Nothing was cached before it (calls arriving in the same step may share the blocks the first one computes).
    assert first.shapes[0].cached == 0
    # Each run's steps are kept apart (the fitted run's are the last of the fitted steps), each run's level told.
    assert result.held_out_program_runs == (len(result.held_out_programs),)
    (fitted_steps,) = result.fitted_program_runs
    assert sum(s.arrivals for s in result.samples[-fitted_steps:]) == sum(p.num_calls for p in run)
    fitted_ratios, held_ratios = program_run_ratios(result)
    assert len(fitted_ratios) == len(held_ratios) == 1
    assert result.held_out_programs_error is not None
    assert held_ratios[0] == pytest.approx(result.held_out_programs_error.ratio)


@pytest.mark.slow
def test_calibrate_served_collects_the_steps_of_both_instances_of_a_cluster(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    from boundless.config import ClusterConfig

    config = EngineConfig(model=ModelConfig(model=str(model_dirs["tiny-llama"])), cache=CacheConfig(num_kv_blocks=64))
    grid = CalibrationGrid((4,), (8, 64), output_tokens=3, repeats=1)
    cluster = ClusterConfig(instances=2, routing="round-robin")
    result = calibrate_served(tiny_llama, config, grid, cluster=cluster, arrivals=None)
    # Every token of every request, on whichever instance the dispatcher sent it to.
    assert sum(c.new for s in result.samples for c in s.shapes) == sum(4 * (p + 2) for p in grid.prompt_lens)
    assert max(len(s.shapes) for s in result.samples) <= 2  # round-robin: each instance ran half a cell
    # Each step keeps its end on the machine's monotonic clock: the two instances' steps overlap in time, and the fit
    # measures how much a step slows with the other stepping beside it.
    assert all(s.ended_at > 0 for s in result.samples) and result.fit.others == 1


@pytest.mark.slow
def test_calibrate_served_on_prefill_and_decode_engines_fits_both_engines_steps(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from boundless.cli import main

    out, store = tmp_path / "pd.json", tmp_path / "store"
    args = ["simulate", "calibrate", "--served", "--roles", "1:1", "--model", str(model_dirs["tiny-llama"])]
    args += ["--batch-sizes", "2", "--prompt-lens", "8,64", "--output-tokens", "3", "--repeats", "1"]
    args += ["--held-out-batch-sizes", "", "--num-kv-blocks", "64", "--kv-disk-path", str(store)]
    args += ["--kv-write-policy", "through", "--workloads", "chat", "--num-programs", "2", "--rate", "2"]
    assert main([*args, "--out", str(out), "--name", "pd"]) == 0
    calibration = json.loads(out.read_text())["calibration"]
    assert (calibration["instances"], calibration["roles"], calibration["kv_disk_path"]) == (2, "1:1", True)
    samples = samples_from_json(calibration["samples"])
    # Both engines' steps: the prefill engine's prefills and the decode engine's decodes.
    assert any(all(c.new == 1 for c in s.shapes) for s in samples) and any(s.shapes[0].new > 1 for s in samples)
    assert isinstance(load_profile(str(out)).step, FittedStepCost) and list(store.iterdir()) == []
    with pytest.raises(SystemExit, match="one P:D size"):
        main([*args, "--roles", "1:1,1:2", "--out", str(out)])


def test_a_profile_is_written_with_one_step_per_line_and_reads_back_the_same() -> None:
    data = {"name": "p", "calibration": {"when": "now", "samples": [[[[0, 16]], 0.07], [[[16, 1]], 0.03]]}}
    data["calibration"]["held_out_samples"] = []
    text = profile_json(data)
    assert json.loads(text) == data
    assert "      [[[0,16]],0.07],\n      [[[16,1]],0.03]\n" in text
    for name in ("cpu-served", "cpu-served-2inst"):  # the shipped ones are written so
        path = PROFILE_DIR / f"{name}.json"
        assert profile_json(json.loads(path.read_text())) == path.read_text()


def test_a_profiles_samples_refit_to_its_model() -> None:
    samples = _grid_samples(FittedStepCost(KNOWN), repeats=1)
    rows = json.loads(json.dumps(samples_json(samples)))
    assert rows[0][:2] == [[[s.cached, s.new] for s in samples[0].shapes], samples[0].seconds]
    assert samples_from_json(rows) == samples
    assert fit_profile_model(samples_from_json(rows), TWO_THREADS) == fit_profile_model(samples, TWO_THREADS)


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
    assert {"cpu", "cpu-1thread", "a100-80gb", "h100", "h200"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name and profile.host_copy.bytes_per_s > 0
        if isinstance(profile.step, RooflineStepCost):
            for figure in (
                "peak_bf16_tflops",
                "hbm_tbytes_per_s",
                "host_copy",
                "network",
                "storage",
                "gpu_interconnect",
            ):
                assert "datasheet" in profile.sources[figure] or "DGX" in profile.sources[figure], (name, figure)
        else:  # fitted here, with the samples it was fitted on: they refit to its model, at its programs' level
            assert "calibrate on this machine" in profile.sources["step"]
            calibration = json.loads((PROFILE_DIR / f"{name}.json").read_text())["calibration"]
            samples = samples_from_json(calibration["samples"])
            spec = FitSpec(
                calibration.get("form", "linear"),
                calibration.get("per_shape", "fastest"),
                calibration["threads"],
                calibration.get("others", 0),  # a cluster's: the engines beside each step, whose contention is fitted
            )
            level = calibration.get("program_level", 1.0)
            refit = fit_profile_model(samples, spec).scaled(level)
            # Equal up to the last bits: another CPU's BLAS may round a least-squares solve differently.
            assert refit.threads == profile.step.model.threads
            assert refit.coefficients == pytest.approx(profile.step.model.coefficients, rel=1e-9, abs=1e-15)
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


@pytest.mark.parametrize("split", [1, 4])
def test_the_roofline_prices_a_windows_passes_from_its_rows_as_from_their_shapes(split: int) -> None:
    """One GPU's, and a model split over four (``with_tensor_parallel``: its all-reduces in each pass's price)."""
    h100 = with_tensor_parallel(load_profile("h100"), split).step
    assert isinstance(h100, RooflineStepCost)
    rng = random.Random(5)
    for _ in range(50):
        window = rng.randint(1, 32)
        rows = [(rng.randint(0, 9000), rng.choice([1, 1, 3]), rng.randint(1, window)) for _ in range(rng.randint(1, 9))]
        rows[0] = (rows[0][0], rows[0][1], window)
        passes = WindowPasses(rows, window)
        first = rng.randint(0, window - 1)
        expected = [h100.predict(passes[j]) for j in range(first, window)]
        assert h100.predict_passes(rows, first, window) == pytest.approx(expected, rel=1e-12)


def test_validate_compares_the_prediction_with_the_median_of_the_measured_runs() -> None:
    from boundless.sim.simulator import SimResult
    from boundless.sim.validate import compare, simulated_summary

    predicted = simulated_summary([SimResult("a", 0.0, 2.0, 5), SimResult("b", 1.0, 5.0, 5)])
    assert predicted["avg_latency_s"] == 3.0 and predicted["throughput_programs_per_s"] == 2 / 5.0
    runs = [{"avg_latency_s": a, "p95_latency_s": 4.0, "throughput_programs_per_s": 0.4} for a in (4.0, 5.0, 3.0)]
    rows = compare(predicted, runs)
    assert [r["metric"] for r in rows] == ["avg_latency_s", "p95_latency_s", "throughput_programs_per_s"]
    assert rows[0]["measured"] == 4.0 and rows[0]["measured_runs"] == [4.0, 5.0, 3.0]
    assert rows[0]["rel_error"] == pytest.approx(-0.25) and rows[0]["spread"] == pytest.approx(0.5)
    assert rows[2]["rel_error"] == pytest.approx(0.0) and rows[2]["spread"] == 0.0
    again = {**predicted, "avg_latency_s": 5.0}  # the simulation again at the real steps' speed
    row = compare(predicted, runs, again)[0]
    assert row["at_step_speed"] == 5.0 and row["rel_error_at_step_speed"] == pytest.approx(0.25)


def test_a_case_is_simulated_again_at_the_speed_its_real_steps_ran(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    from boundless.config import ClusterConfig
    from boundless.sim.validate import Case, at_step_speed, serve_and_measure, simulate, validate_case

    profile = load_profile("cpu-served")
    slower = at_step_speed(profile, 1.25)
    assert slower is not None and isinstance(slower.step, FittedStepCost) and slower.host_copy == profile.host_copy
    for shapes in ([ChunkShape(0, 300)], [ChunkShape(120, 1)] * 3, [ChunkShape(64, 32), ChunkShape(500, 1)]):
        assert slower.step.predict(shapes) == pytest.approx(1.25 * profile.step.predict(shapes))
    assert at_step_speed(load_profile("h100"), 1.25) is None  # a GPU's published figures: not this machine's steps
    config = EngineConfig(model=ModelConfig(model=str(model_dirs["tiny-llama"])), cache=CacheConfig(num_kv_blocks=256))
    shape = WorkloadShape(scale=0.05, tool_wait_s=0.05)
    case = validate_case(Case("mapreduce", 1), config, shape, 2, 4.0, 0, profile, 1, serve_and_measure(tiny_llama))
    # The simulation again at the speed the real steps ran. The tiny model usually steps faster than the profile's
    # 135M model, but a loaded machine can make it slower: only the direction of the ratio is the machine's.
    ratio = case["engine"]["same_shape_ratio"]
    assert ratio > 0 and ratio != 1
    scaled = at_step_speed(profile, ratio)
    assert scaled is not None
    again = simulate(config, make_programs("mapreduce", 2, 4.0, 0, shape), scaled, ClusterConfig(instances=1))
    avg = case["rows"][0]
    assert avg["at_step_speed"] == again["avg_latency_s"]
    assert (avg["at_step_speed"] < avg["predicted"]) == (ratio < 1)  # faster steps, sooner programs; and slower


def test_a_validated_simulation_is_a_function_of_its_flags() -> None:
    from boundless.bench.workloads import WorkloadShape, make_programs
    from boundless.config import ClusterConfig
    from boundless.sim.validate import simulate

    config = EngineConfig(cache=CacheConfig(num_kv_blocks=300))
    programs = make_programs("mapreduce", 6, 1.0, 0, WorkloadShape(scale=0.1, tool_wait_s=0.2))
    profile = load_profile("h100")
    for instances in (1, 2):
        cluster = ClusterConfig(instances=instances)
        first = simulate(config, programs, profile, cluster)
        assert first == simulate(config, programs, profile, cluster) and first["avg_latency_s"] > 0


@pytest.mark.slow  # (7 s)
def test_validate_prints_a_row_per_case_and_metric_with_the_measured_spread(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from boundless.cli import main

    out = tmp_path / "v.json"
    args = ["simulate", "validate", "--model", str(model_dirs["tiny-llama"]), "--num-programs", "2", "--rate", "2"]
    args += ["--workloads", "mapreduce", "--instances", "1", "--repeats", "2", "--profile", "h100"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["workload"], c["instances"], c["profile"]) for c in result["cases"]] == [("mapreduce", 1, "h100")]
    engine = result["cases"][0]["engine"]  # what the engines did: the real one's steps took its own seconds
    assert engine["measured_steps"] > 0 and engine["predicted_steps"] > 0 and engine["step_time_ratio"] > 0
    assert engine["same_shape_ratio"] > 0  # the real run's own steps, against the profile for their shapes
    runs = result["cases"][0]["real_steps"]  # every step each run took, kept to check a profile offline
    assert len(runs) == 2 and all(len(r) > 0 and all(step[2] > 0 for step in r) for r in runs)  # with end times
    # and the requests that entered and left the engine before each step: every call arrives once and leaves once
    calls = sum(p.num_calls for p in make_programs("mapreduce", 2, 2.0, 0, WorkloadShape(scale=0.1, tool_wait_s=0.2)))
    for r in runs:
        assert sum(step[3] for step in r if len(step) == 5) == calls
        assert 0 < sum(step[4] for step in r if len(step) == 5) < calls  # the last call leaves after the last step
    rows = result["rows"]
    assert len(rows) == 3 and all(len(r["measured_runs"]) == 2 and r["predicted"] > 0 for r in rows)
    for r in rows:
        assert r["rel_error"] == pytest.approx((r["predicted"] - r["measured"]) / r["measured"])
        assert min(r["measured_runs"]) <= r["measured"] <= max(r["measured_runs"]) and r["spread"] >= 0


def _validate_one_chat_case(model_dirs: dict[str, Path], tmp_path: Path, *flags: str) -> dict:
    """``simulate validate`` of 3 chat programs, one real run, on the tiny model with ``flags``: its one case."""
    from boundless.cli import main

    out = tmp_path / "v.json"
    args = ["simulate", "validate", "--model", str(model_dirs["tiny-llama"]), "--num-programs", "3", "--rate", "1"]
    args += ["--workloads", "chat", "--repeats", "1", *flags]
    assert main([*args, "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    return case


@pytest.mark.slow
def test_validate_runs_a_real_two_instance_cluster_beside_the_simulated_one(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    case = _validate_one_chat_case(model_dirs, tmp_path, "--instances", "2", "--cluster-profile", "h100")
    assert case["instances"] == 2 and case["profile"] == "h100"
    assert len(case["rows"]) == 3 and all(r["measured"] > 0 and r["predicted"] > 0 for r in case["rows"])


@pytest.mark.slow
def test_validate_runs_real_prefill_and_decode_engines_beside_the_simulated_ones(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    flags = ["--instances", "", "--roles", "1:1", "--roles-profile", "h100", "--kv-path", "dualpath"]
    flags += ["--kv-disk-path", str(tmp_path / "store"), "--kv-write-policy", "through"]
    case = _validate_one_chat_case(model_dirs, tmp_path, *flags)
    assert (case["instances"], case["roles"], case["profile"]) == (2, "1P1D", "h100")
    assert len(case["rows"]) == 3 and all(r["measured"] > 0 and r["predicted"] > 0 for r in case["rows"])
    # Both engines stepped, real and simulated; each real run had a store of its own, removed after it.
    assert case["engine"]["measured_steps"] > 0 and case["engine"]["predicted_steps"] > 0
    assert list((tmp_path / "store").iterdir()) == []


@pytest.mark.slow
def test_validate_runs_a_real_lending_cluster_beside_the_simulated_one_and_both_lend(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # 4 chat programs on 2 instances of 16 blocks (256 tokens), a request up to 1.5 pools: the long conversation's
    # calls outgrow their pool (8 of them, the same calls on both sides), so each starts on a grant and cannot finish
    # unless the other instance lends to it (a room move, model or not). Lending is needed, not a modelled gain: at
    # one pool no request ever waited for room, and whether a run lent turned on a plan catching one of the tiny
    # model's short calls running and on the sign of the per-pair cost fitted from its wall-clock steps (on 5 December
    # 4 of 16 real runs lent nothing, 5 of 8 before that day's router change).
    flags = ["--instances", "2", "--kv-lending", "on", "--cluster-profile", "h100", "--num-kv-blocks", "16"]
    flags += ["--num-programs", "4", "--lending-interval-s", "0.5", "--lending-min-gain", "0"]
    flags += ["--lending-request-pools", "1.5"]
    case = _validate_one_chat_case(model_dirs, tmp_path, *flags)
    assert (case["instances"], case["kv_lending"], case["profile"]) == (2, "on", "h100")
    assert len(case["rows"]) == 3 and all(r["measured"] > 0 and r["predicted"] > 0 for r in case["rows"])
    lent = case["lending"]
    (real,) = lent["real_runs"]
    simulated = lent["simulated"]
    # Both sides granted the same calls, and each granted call borrowed at least once to finish.
    assert real["requests_granted"] == simulated["requests_granted"] > 0, lent
    for side in (real, simulated):
        assert side["moves"] >= side["requests_granted"] and side["blocks_moved"] >= side["moves"], lent
    assert not lent["real_lent_nothing"] and not lent["simulated_lent_nothing"], lent


def test_validate_refuses_roles_that_are_not_p_colon_d(model_dirs: dict[str, Path]) -> None:
    from boundless.cli import main

    args = ["simulate", "validate", "--model", str(model_dirs["tiny-llama"]), "--instances", ""]
    for roles, message in (("1", "not P:D"), ("0:2", "at least one engine of each role"), ("", "no case")):
        with pytest.raises(SystemExit, match=message):
            main([*args, "--roles", roles])


def test_validate_refuses_lending_with_roles_or_one_instance(model_dirs: dict[str, Path]) -> None:
    from boundless.cli import main

    args = ["simulate", "validate", "--model", str(model_dirs["tiny-llama"]), "--kv-lending", "on"]
    for flags, message in (
        (["--instances", "1,2"], "needs --instances of 2 or more"),
        (["--instances", "2", "--roles", "1:1"], "do not lend"),
        (["--instances", "2", "--lending-interval-s", "0.1"], "--lending-interval-s"),  # under a heartbeat
    ):
        with pytest.raises(SystemExit, match=message):
            main([*args, *flags])
    with pytest.raises(SystemExit):  # neither on nor off: argparse's error
        main([*args[:-1], "yes"])


def _lending_validate_case(real_moves: int) -> dict:
    """validate's lending case of 12 chat programs on 2 instances of 48 blocks, a request up to 1.5 pools, with a
    stand-in real run that made ``real_moves`` moves. The simulation lends there because it must: the conversations
    outgrow a pool, so their longer calls start on a grant and borrow to finish. At one pool its lending was a modelled
    gain of 1-3% (a batch of one's context moved to an idle instance), which the router's change of 5 December (a
    short call stays at its program's home on a tie) took away: the conversations stopped alternating between the
    instances, the per-pair cost fitted on the new steps came out 0 at most plans and too small for the least gain at
    the others, and the simulation lent nothing."""
    from boundless.config import ClusterConfig
    from boundless.sim.validate import Case, validate_case

    def real_run(config, programs, cluster, profile) -> dict:
        assert cluster is not None and cluster.kv_lending == "on" and cluster.instances == 2
        assert cluster.lending_request_pools == 1.5
        lending = {"moves": real_moves, "blocks_moved": 3 * real_moves, "bytes_moved": 0, "round_trips": 0}
        figures = {"avg_latency_s": 9.0, "p95_latency_s": 27.0, "throughput_programs_per_s": 0.17}
        return {
            **figures,
            "busy_s": 80.0,
            "steps": 1900.0,
            "taken_step_s": 80.0,
            "profile_step_s": 80.0,
            "lending": lending,
        }

    config = EngineConfig(cache=CacheConfig(num_kv_blocks=48))
    shape = WorkloadShape(scale=0.1, tool_wait_s=0.2)
    # cpu-served-2inst is a contended profile: the simulator's steps over lent blocks take the contention too.
    profile = load_profile("cpu-served-2inst")
    base = ClusterConfig(lending_request_pools=1.5)
    return validate_case(Case("chat", 2, lending=True), config, shape, 12, 0.25, 0, profile, 1, real_run, base)


@pytest.mark.slow  # (6 s: a simulated 2-instance lending run; validate's other cases stay in the fast suite)
def test_a_lending_case_says_what_each_side_lent_and_warns_when_the_real_one_lent_nothing() -> None:
    from boundless.sim.validate import lending_lines, table_rows

    case = _lending_validate_case(real_moves=0)
    lent = case["lending"]
    assert case["kv_lending"] == "on" and table_rows([case])[0][1] == "2L"
    simulated = lent["simulated"]
    assert simulated["moves"] > 0 and simulated["blocks_moved"] > 0 and not lent["simulated_lent_nothing"]
    assert simulated["moves"] >= simulated["requests_granted"] > 0  # each granted call borrowed to finish
    assert lent["real_runs"] == [{"moves": 0, "blocks_moved": 0, "bytes_moved": 0, "round_trips": 0}]
    assert lent["real_lent_nothing"]
    assert any(line.startswith("WARNING") and "real run lent nothing" in line for line in lending_lines(case))
    lent_too = _lending_validate_case(real_moves=4)
    assert not lent_too["lending"]["real_lent_nothing"]
    assert not any(line.startswith("WARNING") for line in lending_lines(lent_too))


def test_refit_fits_a_shipped_profiles_kept_steps_again_and_writes_a_profile_that_loads(tmp_path: Path) -> None:
    from boundless.cli import main

    out = tmp_path / "refit.json"
    shipped = PROFILE_DIR / "cpu-served.json"
    assert main(["simulate", "calibrate", "--refit", str(shipped), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    calibration = data["calibration"]
    assert (calibration["form"], calibration["per_shape"], calibration["refit_of"]) == (
        "cpu-kernels",
        "all",
        str(shipped),
    )
    assert calibration["samples"] == json.loads(shipped.read_text())["calibration"]["samples"]  # the same steps
    refitted = load_profile(str(out)).step
    assert isinstance(refitted, FittedStepCost) and refitted.model.threads == 2
    spec = FitSpec("cpu-kernels", "all", 2)
    fit = fit_profile_model(samples_from_json(calibration["samples"]), spec)
    assert fit.scaled(calibration["program_level"]) == refitted.model  # deterministic, at its program runs' level
    # The held-out shapes it was never fitted on: this form does no worse on its worst than the shipped one (which is
    # of this form since stop 24: the same fit).
    assert (
        calibration["held_out_error"]["worst"]
        <= json.loads(shipped.read_text())["calibration"]["held_out_error"]["worst"]
    )
