"""``boundless simulate calibrate``: fit this machine's step model from the real engine, write a profile.

The real engine runs batches over a small grid of shapes (requests per batch x prompt length, a few
output tokens each, so the steps are prefills, chunked prefills over cached context, and decodes over
contexts of each length). The engine records every step's shapes and seconds itself
(``EngineCore.step_times``, the executor's timer around the forward pass and sampling).

The machine may be shared: another process on the cores only ever adds time to a step, so the grid runs
``repeats`` times (whole passes, so a burst of load hits one pass, not every repeat of a shape) and the fit
takes each exact step shape's fastest time (:func:`fastest_per_shape`). The fit is the engine's own
(``fit_attention_time``), in relative error so the short decode steps weigh as much as the long prefills,
without the steps still slowed by something other than their shape. A second, held-out grid of other
shapes measures how well the fit predicts steps it was not fitted on.

``--served`` runs both grids through a served engine instead (``sim/served_grid.py``: the HTTP server and the
``openai`` client, and with ``--instances 2`` a Ray cluster behind the dispatcher, as ``simulate validate``'s
real side runs), since serving slows every step of this machine's engine. There the fit takes each shape's
**median** over the passes (:func:`median_per_shape`): the serving's own share of a step is part of what the
simulator must charge, and it is in every pass, while a burst of outside load hits one.

``--served --workloads`` also fits served programs' steps, and holds out another seed's: each run on a fresh engine
(or cluster) with validate's engine flags, as each of validate's repeats is served (``run_programs_on_a_fresh_engine``):
the same shapes cost a level of their own on each fresh engine, so ``--program-runs`` fitted runs sample several.

``--served --instances 2 --kv-lending on`` calibrates a cluster whose instances lend KV blocks (with the
``--lending-*`` knobs, its program runs on the grid's ``--num-kv-blocks``): the steps over lent blocks, which also
wait for their creditors' partials, stay out of the step model (``step_model.local_steps``), and the network latency
is set so that the simulated debtors of the fitted runs wait as long per round trip as the real ones did
(:func:`fit_lending_latency`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from boundless.bench.programs import served_engine
from boundless.bench.report import output_path
from boundless.bench.workloads import WORKLOADS, ProgramSpec, WorkloadShape, make_programs
from boundless.config import (
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    comma_numbers,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from boundless.engine.attention_time import AttentionSample, ChunkShape, fit_attention_time
from boundless.engine.core import EngineCore
from boundless.engine.lending_stats import LendingStats
from boundless.model.loader import LoadedModel, load_configured_model
from boundless.sim.cost import (
    DISK_LATENCY_S,
    DISK_READ_BYTES_PER_S,
    DISK_WRITE_BYTES_PER_S,
    HOST_COPY_BYTES_PER_S,
)
from boundless.sim.grid import WARM_UP_GRID, CalibrationGrid, fastest_per_shape, median_per_shape, run_grid, step_shape
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import (
    FittedStepCost,
    fitted_profile_dict,
    profile_data,
    profile_from_dict,
    profile_from_flag,
)
from boundless.sim.run import parse_roles
from boundless.sim.served_grid import (
    MODEL_NAME,
    ServedProgramsRun,
    add_roles_arguments,
    fresh_store,
    roles_cluster_base,
    run_programs_on_a_fresh_engine,
    run_served_grid,
)
from boundless.sim.step_model import (
    StepTimeModel,
    fit_step_model,
    local_steps,
    samples_from_json,
    samples_json,
)
from boundless.sim.validate import LENDING_FLAGS, add_lending_arguments, lending_cluster, simulate

FORMS = ("cpu-kernels", "linear")
# A step slower than this many times the fit's prediction was slowed by something else (as perf_model's).
OUTLIER_FACTOR = 1.5


# Shapes the fit never sees, between and beside the default grid's, to measure its error on.
HELD_OUT_GRID = CalibrationGrid((5, 7), (64, 384, 768), output_tokens=6, repeats=2)
# Served calibration's cells of requests arriving one at a time over a shared prefix, fitted and held out: a
# served engine's prefill step also carries the server admitting its request (per_prefill_s), which a cell of
# requests sent together spreads over one step.
ARRIVALS_GRID = CalibrationGrid((4,), (16, 64, 160), output_tokens=8, repeats=2, arrival_gap_s=0.15, shared_prefix=48)
HELD_OUT_ARRIVALS_GRID = CalibrationGrid(
    (3,), (32, 96), output_tokens=6, repeats=2, arrival_gap_s=0.1, shared_prefix=80
)


@dataclass(frozen=True)
class FitError:
    """Relative errors of a model's predictions over a set of step shapes."""

    steps: int
    median: float
    p90: float
    worst: float


@dataclass(frozen=True)
class ProgramsError:
    """How a fit predicts served programs' steps: their seconds over the fit's for them (each step with its
    departures and contention), in all, and each step's relative error."""

    steps: int
    ratio: float
    median: float
    p90: float


def programs_error(model: StepTimeModel, samples: Sequence[AttentionSample], others: int = 0) -> ProgramsError:
    """``model`` on served programs' steps (``others``: the engines beside each, for a contended model), those over
    lent blocks left out (``local_steps``)."""
    steps = local_steps(samples, others if model.per_contention_s else 0)
    predicted = [model.predict_sample(s, c) for s, c in steps]
    errors = sorted(abs(p - s.seconds) / s.seconds for (s, _), p in zip(steps, predicted, strict=True))
    ratio = sum(s.seconds for s, _ in steps) / sum(predicted)
    return ProgramsError(len(steps), ratio, statistics.median(errors), errors[int(0.9 * (len(errors) - 1))])


@dataclass(frozen=True)
class FitSpec:
    """How a profile's step model is fitted from its measured steps: ``form`` ``cpu-kernels`` (every term of
    :class:`~boundless.sim.step_model.StepTimeModel`, on ``threads``) or ``linear`` (the engine's own
    ``AttentionTimeModel``, as the profiles before the kernel terms were fitted), on which steps (``per_shape``)."""

    form: str = "cpu-kernels"
    per_shape: str = "fastest"
    threads: int = 1
    others: int = 0  # the engines beside each (a cluster's instances less one): their contention is fitted


@dataclass(frozen=True)
class Calibration:
    model: StepTimeModel
    samples: list[AttentionSample]  # every measured step, all repeats
    held_out: list[AttentionSample]  # every measured step of the held-out grid
    fit_error: FitError  # on the fastest time of each fitted shape
    held_out_error: FitError | None  # on the fastest time of each held-out shape
    wall_s: float
    fit: FitSpec = FitSpec()
    # Served programs' steps the fit never saw (``calibrate --served --workloads``: other programs than the fitted
    # ones, and than validate's), and how the fit predicts them.
    held_out_programs: tuple[AttentionSample, ...] = ()
    held_out_programs_error: ProgramsError | None = None
    # The steps of each served program run, in order: the fitted runs' (the last of ``samples``) and the held-out
    # runs' (``held_out_programs``). Each ran on a fresh engine, at its own level (:func:`program_run_ratios`).
    fitted_program_runs: tuple[int, ...] = ()
    held_out_program_runs: tuple[int, ...] = ()
    # With KV lending: what the fitted program runs lent, summed (their round trips and the waits they exposed).
    program_lending: LendingStats | None = None
    # The fitted program runs' level over the fit of every step (:func:`program_level`); ``model`` is at it.
    program_level: float = 1.0


def program_run_ratios(result: Calibration) -> tuple[list[float], list[float]]:
    """Each program run's steps over the fit's time for them: the fitted runs', then the held-out runs'."""
    fitted_steps = result.samples[len(result.samples) - sum(result.fitted_program_runs) :]
    return run_ratios(result.model, fitted_steps, result.fitted_program_runs, result.fit.others), run_ratios(
        result.model, result.held_out_programs, result.held_out_program_runs, result.fit.others
    )


def run_ratios(
    model: StepTimeModel, steps: Sequence[AttentionSample], counts: Sequence[int], others: int
) -> list[float]:
    """Each run of ``steps`` (consecutive, ``counts`` steps each; empty ones skipped): its seconds over the model's."""
    return [programs_error(model, run, others).ratio for run in split_runs(steps, counts) if run]


def split_runs(steps: Sequence[AttentionSample], counts: Sequence[int]) -> list[Sequence[AttentionSample]]:
    """``steps`` cut into consecutive runs of ``counts`` steps each."""
    ends = itertools.accumulate(counts)
    return [steps[end - n : end] for n, end in zip(counts, ends, strict=True)]


PerShape = Callable[[Sequence[AttentionSample]], list[AttentionSample]]
# Which steps a fit takes: each shape's fastest (the bare engine), each shape's median (the served profiles before
# the kernel terms), or every step with least absolute error (a served engine: see sim/step_model.py).
PER_SHAPE: dict[str, PerShape] = {"fastest": fastest_per_shape, "median": median_per_shape, "all": list}
# The time of each shape its errors are told on: the fastest for a fastest fit, else the median.
ERROR_PER_SHAPE: dict[str, PerShape] = {
    "fastest": fastest_per_shape,
    "median": median_per_shape,
    "all": median_per_shape,
}


def fit_profile_model(samples: Sequence[AttentionSample], spec: FitSpec = FitSpec()) -> StepTimeModel:
    """The profile's step model over ``samples``, in relative error, without the steps still slowed by something
    other than their shape."""
    chosen = PER_SHAPE[spec.per_shape](samples)
    if spec.form == "linear":  # exactly the fit the earlier profiles were made with
        local = [s for s in chosen if not s.remote]
        linear = fit_attention_time(local, relative=True, outlier_factor=OUTLIER_FACTOR)
        return StepTimeModel.from_json(dataclasses.asdict(linear))
    if spec.form != "cpu-kernels":
        raise ValueError(f"unknown step model form {spec.form!r}: one of {', '.join(FORMS)}")
    robust = spec.per_shape == "all"
    return fit_step_model(chosen, spec.threads, robust, OUTLIER_FACTOR, others=spec.others)


def relative_errors(model: StepTimeModel, samples: Sequence[AttentionSample]) -> list[float]:
    return [(model.predict_sample(s) - s.seconds) / s.seconds for s in samples if s.seconds > 0 and not s.remote]


def fit_error(
    model: StepTimeModel, samples: Sequence[AttentionSample], per_shape: str = "fastest", others: int = 0
) -> FitError:
    """The model's relative errors on each shape's fastest (or median) time; with ``others`` (a cluster's), on
    each shape's median error, every step predicted with the contention it ran under."""
    if others and model.per_contention_s:
        by_shape: dict[tuple[ChunkShape, ...], list[float]] = {}
        for s, beside in local_steps(samples, others):
            by_shape.setdefault(step_shape(s), []).append((model.predict_sample(s, beside) - s.seconds) / s.seconds)
        errors = sorted(abs(statistics.median(e)) for e in by_shape.values())
    else:
        errors = sorted(abs(e) for e in relative_errors(model, ERROR_PER_SHAPE[per_shape](samples)))
    return FitError(len(errors), statistics.median(errors), errors[int(0.9 * (len(errors) - 1))], errors[-1])


def median_rel_error(model: StepTimeModel, samples: Sequence[AttentionSample]) -> float:
    return fit_error(model, samples).median


def calibrate(
    loaded: LoadedModel,
    config: EngineConfig,
    grid: CalibrationGrid,
    held_out: CalibrationGrid | None = None,
    form: str = "cpu-kernels",
) -> Calibration:
    """The grids on a bare engine stepped in a loop, fitted on each shape's fastest time."""
    core = EngineCore.from_model(loaded, config)
    start = time.monotonic()
    run_grid(core, WARM_UP_GRID)
    samples = run_grid(core, grid)
    held = run_grid(core, held_out, seed=1) if held_out is not None else []
    return fitted(samples, held, time.monotonic() - start, FitSpec(form, "fastest", torch.get_num_threads()))


def calibrate_served(
    loaded: LoadedModel,
    config: EngineConfig,
    grid: CalibrationGrid,
    held_out: CalibrationGrid | None = None,
    cluster: ClusterConfig | None = None,
    form: str = "cpu-kernels",
    arrivals: tuple[CalibrationGrid, CalibrationGrid] | None = (ARRIVALS_GRID, HELD_OUT_ARRIVALS_GRID),
    programs: tuple[list[list[ProgramSpec]], list[list[ProgramSpec]]] | None = None,
    programs_config: EngineConfig | None = None,
) -> Calibration:
    """The grids through a served engine (or cluster), fitted on every step (least absolute error); with
    ``arrivals``, also a grid of requests arriving one at a time over a shared prefix, and a held-out one; with
    ``programs``, also the steps of served programs (the first runs, fitted) and of others (held out): the
    workloads' own steps, with the server's arrivals and departures beside them, served as validate serves them:
    each run its workload's programs at their arrival times on a fresh engine (or cluster) with ``programs_config``
    (validate's engine flags; default ``config``)."""
    vocab = loaded.arch.vocab_size
    with (
        fresh_store(config) as grid_config,
        served_engine(loaded, grid_config, cluster, model_name=MODEL_NAME) as served,
    ):
        start = time.monotonic()
        run_served_grid(served, WARM_UP_GRID, vocab, seed=2)  # not kept
        samples = run_served_grid(served, grid, vocab)
        if arrivals is not None:
            samples += run_served_grid(served, arrivals[0], vocab, seed=3)
        held = run_served_grid(served, held_out, vocab, seed=1) if held_out is not None else []
        if arrivals is not None and held_out is not None:
            held += run_served_grid(served, arrivals[1], vocab, seed=4)
    fitted_runs: list[ServedProgramsRun] = []
    held_runs: list[ServedProgramsRun] = []
    for runs, out in zip(programs or ([], []), (fitted_runs, held_runs), strict=True):
        out += [run_programs_on_a_fresh_engine(loaded, programs_config or config, cluster, run) for run in runs]
    samples += [s for run in fitted_runs for s in run.steps]
    wall = time.monotonic() - start
    others = cluster.num_engines - 1 if cluster is not None else 0
    result = fitted(samples, held, wall, FitSpec(form, "all", engine_threads(cluster), others))
    result = with_program_runs(result, [len(r.steps) for r in fitted_runs], [r.steps for r in held_runs])
    lent = [lending for r in fitted_runs if (lending := r.lending) is not None]
    return dataclasses.replace(result, program_lending=LendingStats.total(lent) if lent else None)


def program_level(ratios: Sequence[float]) -> float:
    """How much longer served programs' steps took in all than the fit says for them: the median of the fitted
    runs' ``ratios`` (:func:`run_ratios`; 1.0 with none).

    The fit is least absolute relative error, each step's median, robust to the steps slowed by something else; but a
    served step's time is skewed (most near their shape's time, some much longer: a call arriving, the server
    answering one, outside load), and a program's latency adds its steps' times, their mean. On 2 December (06:33 UTC,
    one instance) the fitted program steps' median was x1.05 the fit and their total x1.12 (the grids' steps, an
    eighth of all, ran x0.92 it), the held-out programs took x1.13 it, and validate's latencies came out 6-15% short.
    So the model is scaled to the programs' total, and the fit still gives each term its share."""
    return statistics.median(ratios) if ratios else 1.0


def with_program_runs(
    result: Calibration, fitted_runs: Sequence[int], held_runs: Sequence[Sequence[AttentionSample]]
) -> Calibration:
    """``result`` with its fitted program runs' step counts, its model at their level (:func:`program_level`, with
    the fit's errors on the grids measured again at it), the held-out runs' steps and the model's error on them."""
    fitted_steps = result.samples[len(result.samples) - sum(fitted_runs) :]
    level = program_level(run_ratios(result.model, fitted_steps, fitted_runs, result.fit.others))
    if level != 1.0:
        model = result.model.scaled(level)
        fit, held_grid = grid_errors(model, result.samples, result.held_out, result.fit)
        result = dataclasses.replace(result, model=model, fit_error=fit, held_out_error=held_grid)
    held = tuple(s for run in held_runs for s in run)
    error = programs_error(result.model, held, result.fit.others) if held else None
    return dataclasses.replace(
        result,
        program_level=level,
        held_out_programs=held,
        held_out_programs_error=error,
        fitted_program_runs=tuple(fitted_runs),
        held_out_program_runs=tuple(len(r) for r in held_runs),
    )


def engine_threads(cluster: ClusterConfig | None) -> int:
    """Torch threads of each engine: this process's, or each actor's share of the cores (ClusterClient's rule)."""
    if cluster is None:
        return torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) // cluster.num_engines)


def fitted(samples: list[AttentionSample], held: list[AttentionSample], wall_s: float, spec: FitSpec) -> Calibration:
    """The fit of the grid's steps, and its errors on them and on the held-out grid's."""
    model = fit_profile_model(samples, spec)
    fit, held_error = grid_errors(model, samples, held, spec)
    return Calibration(model, samples, held, fit, held_error, wall_s, spec)


def grid_errors(
    model: StepTimeModel, samples: Sequence[AttentionSample], held: Sequence[AttentionSample], spec: FitSpec
) -> tuple[FitError, FitError | None]:
    """``model``'s errors on the fitted grid's steps, and on the held-out grid's (None without any)."""
    held_error = fit_error(model, held, spec.per_shape, spec.others) if held else None
    return fit_error(model, samples, spec.per_shape, spec.others), held_error


def _grid(
    batch_sizes: str, prompt_lens: str, output_tokens: int, repeats: int, held_out: bool = False
) -> CalibrationGrid:
    """The grid of the flags' sizes (``held_out``: the held-out grid's flags), checked before anything is measured:
    a batch size of 0 failed only when the fit found no steps, after every shape had run."""
    flag = "--held-out-" if held_out else "--"
    return CalibrationGrid(
        tuple(comma_numbers(f"{flag}batch-sizes", batch_sizes, int, positive=True)),
        tuple(comma_numbers(f"{flag}prompt-lens", prompt_lens, int, positive=True)),
        output_tokens,
        repeats,
    )


def _grid_text(grid: CalibrationGrid) -> str:
    arrivals = (
        f", {grid.arrival_gap_s} s apart over a shared prefix of {grid.shared_prefix} tokens"
        if grid.arrival_gap_s or grid.shared_prefix
        else ""
    )
    return (
        f"batch sizes {grid.batch_sizes} x prompt lengths {grid.prompt_lens}, {grid.output_tokens} output tokens,"
        f" {grid.repeats} repeats{arrivals}"
    )


def _error_text(e: FitError | None) -> str:
    if e is None:
        return "none"
    return f"median {e.median:.1%}, p90 {e.p90:.1%}, worst {e.worst:.1%} over {e.steps} shapes"


def profile_json(data: dict) -> str:
    """A profile as JSON text, indented, with one measured step per line (as the shipped profiles keep them)."""
    calibration = data.get("calibration", {})
    steps = {k: calibration[k] for k in ("samples", "held_out_samples") if k in calibration}
    placeholders = {k: f"@{k}@" for k in steps}
    text = json.dumps({**data, "calibration": {**calibration, **placeholders}}, indent=2)
    for k, rows in steps.items():
        lines = ",\n".join("      " + json.dumps(r, separators=(",", ":")) for r in rows)
        text = text.replace(json.dumps(placeholders[k]), "[\n" + lines + "\n    ]" if rows else "[]")
    return text + "\n"


def _model_text(m: StepTimeModel) -> str:
    return (
        f"base {m.base_s * 1e3:.2f} ms, per request {m.per_seq_s * 1e3:.3f} ms, per prefill"
        f" {m.per_prefill_s * 1e3:.3f} ms, per matmul row"
        f" {m.per_row_s * 1e3:.3f} ms, per row group {m.per_row_group_s * 1e3:.3f} ms, per cached token"
        f" {m.per_cached_s * 1e6:.3f} us, per query-key pair {m.per_pair_s * 1e9:.3f} ns ({m.threads} threads);"
        f" per contended step {m.per_contention_s * 1e3:.3f} ms (every other engine stepping beside it);"
        f" per departure {m.per_departure_s * 1e3:.3f} ms"
    )


def _fit_text(result: Calibration) -> str:
    which = {"fastest": "the fastest of each shape", "median": "the median of each shape"}
    how = which.get(result.fit.per_shape, "every step, least absolute error")
    return f"{result.fit.form} model on {how}"


def _print_result(result: Calibration) -> None:
    print(f"fit ({_fit_text(result)}), on each shape: {_error_text(result.fit_error)}")
    print(f"held-out shapes: {_error_text(result.held_out_error)}")
    if result.held_out_programs_error is not None:
        print(f"held-out programs: {_programs_text(result.held_out_programs_error)}")
    if result.fitted_program_runs:  # kept since runs are served on fresh engines
        print(f"the fit of every step, at the fitted program runs' level: x{result.program_level:.3f}")
        fitted_runs, held_runs = program_run_ratios(result)
        print(
            "each program run (a fresh engine each) over the fit: fitted "
            + " ".join(f"x{r:.3f}" for r in fitted_runs)
            + ", held out "
            + " ".join(f"x{r:.3f}" for r in held_runs)
        )
    print(_model_text(result.model))


def _programs_text(e: ProgramsError) -> str:
    return f"{e.steps} steps took x{e.ratio:.3f} the fit's time; each step: median {e.median:.1%}, p90 {e.p90:.1%}"


def _calibration_figures(result: Calibration) -> dict:
    """What a profile's ``calibration`` says of its fit."""
    return {
        "form": result.fit.form,
        "per_shape": result.fit.per_shape,
        "threads": result.fit.threads,
        "others": result.fit.others,
        "fit_error": vars(result.fit_error),
        "held_out_error": vars(result.held_out_error) if result.held_out_error else None,
        "median_rel_error": result.fit_error.median,
        "held_out_programs_error": vars(result.held_out_programs_error) if result.held_out_programs_error else None,
        "program_run_steps": {
            "fitted": list(result.fitted_program_runs),
            "held_out": list(result.held_out_program_runs),
        },
        "program_level": result.program_level,
    }


@dataclass(frozen=True)
class LendingLatencyFit:
    """The network link a lending profile gets (:func:`fit_lending_latency`), and the waits it was set from."""

    network: LinkSpec
    measured_per_round_trip_s: float
    measured_round_trips: int
    simulated_per_round_trip_s: float
    rounds: int


def latency_for_exposure(
    latency_s: float, simulated_per_round_trip_s: float, measured_per_round_trip_s: float
) -> float:
    """The next latency to try: a round trip crosses the link twice (``sim/lending.py``: the queries out, the
    partials back), so each second of latency exposes two of wait while any is exposed."""
    return max(0.0, latency_s + (measured_per_round_trip_s - simulated_per_round_trip_s) / 2)


def fit_lending_latency(
    measured: LendingStats,
    profile_dict: Callable[[LinkSpec], dict],
    network: LinkSpec,
    runs: Sequence[list[ProgramSpec]],
    config: EngineConfig,
    cluster: ClusterConfig,
    rounds: int = 3,
    tolerance: float = 0.02,
) -> LendingLatencyFit:
    """The network latency at which the simulator's debtors wait as long per round trip for their creditors'
    partials (``exposed_wait_s``) as the real debtors of the fitted program ``runs`` did: the real round trip on
    this machine is bound by each process getting its core and interpreter to answer (``docs/simulation.md``, KV
    lending), not by bytes, so it is measured, not assumed. The runs are simulated on the fitted step model with
    each latency tried (``profile_dict``: the profile with that link), at most ``rounds`` times, until within
    ``tolerance``; the link returned is the last one simulated."""
    target = measured.exposed_wait_s / max(1, measured.round_trips)
    tried = 0
    while True:
        profile = profile_from_dict(profile_dict(network))
        totals = [simulate(config, run, profile, cluster)["lending"] for run in runs]
        simulated = sum(t["exposed_wait_s"] for t in totals) / max(1, sum(t["round_trips"] for t in totals))
        tried += 1
        if abs(simulated - target) <= tolerance * target or tried == rounds:
            break
        network = dataclasses.replace(network, latency_s=latency_for_exposure(network.latency_s, simulated, target))
    return LendingLatencyFit(network, target, measured.round_trips, simulated, tried)


def run(args: argparse.Namespace) -> dict:
    if args.refit:
        return refit(args)
    if args.check:  # (else a calibration of minutes ran, the checks never read)
        raise SystemExit("--check: with --refit only (it checks a refitted profile against validate's real steps)")
    grid = _grid(args.batch_sizes, args.prompt_lens, args.output_tokens, args.repeats)
    held_out = (
        _grid(args.held_out_batch_sizes, args.held_out_prompt_lens, HELD_OUT_GRID.output_tokens, args.repeats, True)
        if args.held_out_batch_sizes
        else None
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    cluster = calibrated_cluster(args)
    lending = cluster is not None and cluster.kv_lending == "on"
    threads = engine_threads(cluster)
    # A disk store (--kv-disk-path) serves the grid and the programs as validate's: each program run on a fresh one.
    store = {"kv_disk_path": args.kv_disk_path, "kv_write_policy": args.kv_write_policy} if args.kv_disk_path else {}
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks, **store),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
    )
    loaded = load_configured_model(config.model, "cpu")
    load_before = os.getloadavg()[0]
    programs = calibration_programs(args) if args.workloads else None
    if programs is not None and not args.served:
        raise SystemExit("--workloads needs --served (the programs' steps are a served engine's)")
    if args.served:
        # The programs run as validate runs them: its engine flags (the engine's defaults), not the grid's smaller
        # pool and step budget (the grid's budget is below its longest prompt, to chunk it).
        # With KV lending, on the grid's pool: lending is what a small pool makes (validate's lending case passes
        # the same --num-kv-blocks).
        pool = {"num_kv_blocks": args.num_kv_blocks} if lending else {}
        programs_config = EngineConfig(model=config.model, cache=CacheConfig(**store, **pool))
        result = calibrate_served(
            loaded, config, grid, held_out, cluster, args.form, programs=programs, programs_config=programs_config
        )
    else:
        if cluster is not None:
            raise SystemExit("--instances above 1 needs --served (a cluster is calibrated as it is served)")
        result = calibrate(loaded, config, grid, held_out, args.form)
    load_after = os.getloadavg()[0]
    how = (
        f"served ({_cluster_text(cluster)} behind the HTTP server, the openai client)"
        if args.served
        else ("the engine stepped alone")
    )
    print(
        f"{len(result.samples)} + {len(result.held_out)} held-out steps in {result.wall_s:.0f} s on {threads} threads,"
        f" {how} (load average {load_before:.1f} before, {load_after:.1f} after)"
    )
    _print_result(result)
    links = {
        "host_copy": LinkSpec(HOST_COPY_BYTES_PER_S),
        "storage_read": LinkSpec(DISK_READ_BYTES_PER_S, DISK_LATENCY_S),
        "storage_write": LinkSpec(DISK_WRITE_BYTES_PER_S, DISK_LATENCY_S),
        "network": LinkSpec(args.net_gbytes_per_s * 1e9, 5e-5),
    }
    lending_fit = None
    if lending and programs is not None and result.program_lending is not None:
        assert cluster is not None
        lending_fit = fit_lending_latency(
            result.program_lending,
            lambda network: fitted_profile_dict(args.name, "", result.model, {**links, "network": network}, {}),
            links["network"],
            programs[0],
            programs_config,
            cluster,
        )
        links["network"] = lending_fit.network
    sources = {
        "step": f"boundless simulate calibrate on this machine ({os.cpu_count()} cores, torch on {threads} threads):"
        f" {args.model} {args.dtype}, {how}, {_grid_text(grid)}, {_fit_text(result)};"
        f" held-out shapes: {_error_text(result.held_out_error)}",
        "host_copy": "sim/cost.py HOST_COPY_BYTES_PER_S: HostSwapSpace copies measured at 10-14 GB/s on this machine",
        "storage": "sim/cost.py DISK_*: a local NVMe drive's sequential bandwidths, not measured",
        "network": "assumption: shared-memory transport between processes on one machine; not measured",
    }
    # None: the runs lent nothing, or made no round trip; the latency stays the assumption.
    lending_fit_json = dataclasses.asdict(lending_fit) if lending_fit is not None else None
    if lending_fit is not None:
        sources["network"] = (
            f"bandwidth assumed ({args.net_gbytes_per_s:g} GB/s); latency set so that the simulated debtors of the"
            f" fitted program runs wait as long per round trip for their creditors' partials as the real ones did"
            f" ({lending_fit.measured_per_round_trip_s * 1e6:.0f} us over {lending_fit.measured_round_trips}"
            f" round trips; simulated {lending_fit.simulated_per_round_trip_s * 1e6:.0f} us)"
        )
    description = (
        f"{args.model} {args.dtype} on this machine's CPU ({os.cpu_count()} cores, torch on {threads} threads"
        f"{' per instance' if cluster else ''}), {how}"
    )
    data = fitted_profile_dict(args.name, description, result.model, links, sources)
    data["calibration"] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "served": args.served,
        "instances": cluster.num_engines if cluster is not None else 1,  # engines: those beside each contend
        "roles": args.roles or None,
        # What validate --kv-lending on must be given again: the knobs the lending ran under, and what it measured.
        **(
            {"kv_lending": {**{k: getattr(cluster, k) for k in LENDING_FLAGS}, "latency_fit": lending_fit_json}}
            if lending
            else {}
        ),
        "kv_disk_path": bool(args.kv_disk_path),
        # What validate --roles must be given again: the read path and the emulated links the steps ran under.
        **(
            {"kv_path": args.kv_path, "storage_gbps": args.storage_gbps, "net_gbps": args.net_gbps}
            if args.roles
            else {}
        ),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "grid": _grid_text(grid),
        "held_out_grid": _grid_text(held_out) if held_out else None,
        "arrivals_grids": [_grid_text(g) for g in (ARRIVALS_GRID, HELD_OUT_ARRIVALS_GRID)] if args.served else None,
        "workloads": _programs_description(args) if programs is not None else None,
        "steps": len(result.samples),
        **_calibration_figures(result),
        "wall_s": result.wall_s,
        "samples": samples_json(result.samples),
        "held_out_samples": samples_json(result.held_out),
        "held_out_program_samples": samples_json(result.held_out_programs),
    }
    _write(args.out or "cpu-profile.json", data)
    return data


def calibrated_cluster(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster calibrate serves on: ``--instances`` above 1, or one ``--roles`` size (prefill and decode engines
    with ``--kv-path`` and the emulated links); None for one engine."""
    roles = parse_roles(args.roles)
    if len(roles) > 1 or (roles and args.instances > 1):
        raise SystemExit("--roles: one P:D size, without --instances")
    if args.kv_lending == "on" and (roles or args.instances < 2 or not args.served):
        raise SystemExit("--kv-lending on: needs --served and --instances of 2 or more, without --roles")
    if roles:
        if not args.served:
            raise SystemExit("--roles needs --served (prefill and decode engines are calibrated as they are served)")
        (prefill, decode) = roles[0]
        return dataclasses.replace(roles_cluster_base(args), prefill_instances=prefill, decode_instances=decode)
    if args.kv_lending == "on":
        return lending_cluster(ClusterConfig(instances=args.instances, kv_lending="on"), args)
    return ClusterConfig(instances=args.instances) if args.instances > 1 else None


def _cluster_text(cluster: ClusterConfig | None) -> str:
    if cluster is None:
        return "1 instance"
    if cluster.disaggregated:
        links = "".join(
            f", {name} {gbps:g} Gbit/s"
            for name, gbps in (("storage", cluster.storage_gbps), ("network", cluster.net_gbps))
            if gbps is not None
        )
        return f"{cluster.roles[0]} prefill and {cluster.roles[1]} decode engines, {cluster.kv_path} read path{links}"
    if cluster.kv_lending == "on":
        return f"{cluster.instances} instances lending KV blocks ({cluster.lending_request_pools:g} pools a request)"
    return f"{cluster.instances} instances"


def calibration_programs(args: argparse.Namespace) -> tuple[list[list[ProgramSpec]], list[list[ProgramSpec]]]:
    """``--workloads``' programs to fit on (``--program-runs`` runs per workload, seeds from ``--workload-seed``) and
    to hold out (a run per workload, the next seed): the shapes and rates validate runs, never its programs
    (validate's ``--bench-seed`` is 0 by default). Each run is served on a fresh engine, as each of validate's
    repeats is, so several fitted runs sample several engines' levels."""
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in names:
        if w not in WORKLOADS or w == "trace":
            raise SystemExit(f"--workloads: unknown workload {w!r}")
    shape = WorkloadShape(scale=args.scale, tool_wait_s=args.tool_wait)

    def programs(seed: int) -> list[list[ProgramSpec]]:
        return [make_programs(w, args.num_programs, args.rate, seed, shape) for w in names]

    runs = max(1, args.program_runs)
    fitted_runs = [run for seed in range(args.workload_seed, args.workload_seed + runs) for run in programs(seed)]
    return fitted_runs, programs(args.workload_seed + runs)


def _programs_description(args: argparse.Namespace) -> str:
    runs = max(1, args.program_runs)
    last = args.workload_seed + runs - 1
    seeds = f"seed {args.workload_seed}" if runs == 1 else f"seeds {args.workload_seed}-{last}"
    return (
        f"{args.workloads}: {args.num_programs} programs each at {args.rate}/s (scale {args.scale}, tool wait"
        f" {args.tool_wait} s), {seeds} fitted, seed {last + 1} held out, each run on a fresh engine with validate's"
        " engine flags"
    )


def _write(path: str, data: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_json(data))
    print(f"wrote {out}")


def refit(args: argparse.Namespace) -> dict:
    """``calibrate --refit PROFILE``: the profile's kept steps fitted again (in ``--form``), offline; its errors on
    the same fitted and held-out shapes, and with ``--check`` on the steps a validate run measured."""
    # A shipped profile by name, as --profile takes one, or a file; checked before anything is fitted.
    before = profile_from_flag("--refit", args.refit).step
    data = profile_data(args.refit)
    if "calibration" not in data or not isinstance(before, FittedStepCost):  # (a roofline profile: published figures)
        raise SystemExit(
            f"--refit: the profile {args.refit!r} keeps no measured steps (simulate calibrate writes those)"
        )
    if missing := [path for path in args.check if not Path(path).is_file()]:  # (read only after the refit)
        raise SystemExit(f"--check: no file {missing[0]!r}")
    calibration = data["calibration"]
    samples = samples_from_json(calibration["samples"])
    held = samples_from_json(calibration.get("held_out_samples", []))
    per_shape = args.per_shape or ("all" if calibration.get("served") else "fastest")
    spec = FitSpec(args.form, per_shape, calibration.get("threads", 1), calibration.get("instances", 1) - 1)
    result = fitted(samples, held, calibration.get("wall_s", 0.0), spec)
    held_programs = samples_from_json(calibration.get("held_out_program_samples", []))
    # Profiles from before the runs were kept: their held-out programs as one run.
    runs = calibration.get("program_run_steps") or {"fitted": [], "held_out": [len(held_programs)]}
    result = with_program_runs(result, runs["fitted"], split_runs(held_programs, runs["held_out"]))
    print(f"{args.refit}: {len(samples)} + {len(held)} held-out steps, refitted")
    _print_result(result)
    for path in args.check:
        print_check(path, calibration.get("instances", 1), {"before": before.model, "refit": result.model})
    step = fitted_profile_dict(data["name"], data.get("description", ""), result.model, {}, {})["step"]
    sources = dict(data.get("sources", {}))
    sources["step"] = (
        f"{sources.get('step', '').split(';')[0]}; refitted offline from its kept steps ({_fit_text(result)});"
        f" held-out shapes: {_error_text(result.held_out_error)}"
    )
    refitted = {**data, "step": step, "sources": sources}
    refitted["calibration"] = {**calibration, **_calibration_figures(result), "refit_of": str(args.refit)}
    if args.out:
        _write(args.out, refitted)
    return refitted


def step_kind(shapes: Sequence[ChunkShape]) -> str:
    """A step's class for the check: decodes by batch size, else prefills (with any decodes) by new tokens."""
    if all(c.new == 1 for c in shapes):
        return f"decode x{len(shapes)}" if len(shapes) <= 8 else "decode x9+"
    tokens = sum(c.new for c in shapes)
    return "prefill <=192 tok" if tokens <= 192 else "prefill >192 tok"


def same_shape_ratios(
    model: StepTimeModel, samples: Sequence[AttentionSample], others: int = 0
) -> dict[str, tuple[int, float]]:
    """By step class (and ``all``): how many steps, and their measured seconds over ``model``'s for the same
    shapes (validate's ``same_shape_ratio``), each step predicted with its contention (``others``: a cluster's)."""
    sums: dict[str, list[float]] = {}
    for s, beside in local_steps(samples, others):
        # Steps after a departure also as a class of their own: the server's work beside them (per_departure_s).
        for kind in ("all", step_kind(s.shapes), *(["after a departure"] if s.departures else [])):
            n, measured, predicted = sums.setdefault(kind, [0, 0.0, 0.0])
            sums[kind] = [n + 1, measured + s.seconds, predicted + model.predict_sample(s, beside)]
    return {k: (int(n), measured / predicted) for k, (n, measured, predicted) in sorted(sums.items())}


def print_check(path: str, instances: int, models: dict[str, StepTimeModel]) -> None:
    """Each case of a validate JSON on ``instances`` instances: the real steps' time over each model's, by class."""
    for case in json.loads(Path(path).read_text())["cases"]:
        if case["instances"] != instances or not case.get("real_steps"):
            continue
        steps = [s for run in case["real_steps"] for s in samples_from_json(run)]
        print(f"{path}: {case['workload']} on {instances}, {len(steps)} real steps; measured / predicted:")
        ratios = {name: same_shape_ratios(m, steps, instances - 1) for name, m in models.items()}
        for kind, (n, _) in ratios[next(iter(models))].items():
            figures = ", ".join(f"{name} x{r[kind][1]:.3f}" for name, r in ratios.items())
            print(f"  {kind:18s} {n:5d} steps  {figures}")
        # Each run (a fresh engine each) apart: the level a run's engine steps at, beside the calibration's runs'.
        for name, m in models.items():
            runs = [programs_error(m, samples_from_json(run), instances - 1).ratio for run in case["real_steps"] if run]
            print(f"  each run, {name}: " + " ".join(f"x{r:.3f}" for r in runs))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = CalibrationGrid()
    parser.add_argument(
        "--out",
        type=output_path,
        help="where to write the profile (default cpu-profile.json; with --refit, nothing written without it)",
    )
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--model", default=ModelConfig.model)
    parser.add_argument("--dtype", default=ModelConfig.dtype)
    parser.add_argument("--batch-sizes", default=",".join(map(str, default.batch_sizes)))
    parser.add_argument("--prompt-lens", default=",".join(map(str, default.prompt_lens)))
    parser.add_argument("--output-tokens", type=positive_int, default=default.output_tokens)
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=default.repeats,
        help="passes over the grid; the fit takes each shape's fastest",
    )
    parser.add_argument(
        "--held-out-batch-sizes",
        default=",".join(map(str, HELD_OUT_GRID.batch_sizes)),
        help="batch sizes of the held-out grid the fit is checked on ('' for none)",
    )
    parser.add_argument("--held-out-prompt-lens", default=",".join(map(str, HELD_OUT_GRID.prompt_lens)))
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch threads (0: torch's default); each of a 2-instance cluster's gets 1 here",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="run the grids through a served engine (HTTP server, openai client) and fit each shape's median",
    )
    parser.add_argument(
        "--instances",
        type=positive_int,
        default=1,
        help="with --served: a Ray cluster of this many instances behind the dispatcher (as serve --instances)",
    )
    add_roles_arguments(
        parser,
        "with --served: a prefill and decode cluster of this P:D size instead (as serve --prefill-instances P"
        " --decode-instances D), with --kv-path and the links --storage-gbps, --net-gbps: validate --roles's profile",
    )
    add_lending_arguments(
        parser,
        "on: with --served --instances 2 or more, the cluster's instances lend KV blocks to each other (as serve"
        " --kv-lending on, with the --lending-* knobs); the program runs use --num-kv-blocks too; the steps over lent"
        " blocks are left out of the fit, and the network latency is set from the runs' measured round trips:"
        " validate --kv-lending on's profile",
    )
    parser.add_argument(
        "--kv-disk-path",
        help="serve with a disk KV store in a fresh directory under this one (each program run its own), as validate"
        " does with the same flag",
    )
    parser.add_argument("--kv-write-policy", default=CacheConfig.kv_write_policy, help="with --kv-disk-path")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    # Below the longest prompt: long prompts run in chunks over cached context, which tells the per-pair
    # term from the per-token one.
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--net-gbytes-per-s", type=float, default=5.0)
    parser.add_argument(
        "--form",
        choices=FORMS,
        default=FORMS[0],
        help="the step model: cpu-kernels (matmul rows on the slowest thread, 4-row groups: sim/step_model.py) or"
        " linear (the engine's AttentionTimeModel, as the profiles before it)",
    )
    parser.add_argument(
        "--workloads",
        default="",
        help="with --served: also serve these programs (comma-separated: chat, mapreduce, ...) and fit on their steps,"
        " and as many others (the next --workload-seed) held out: the steps validate's workloads run",
    )
    parser.add_argument(
        "--workload-seed",
        type=int,
        default=101,
        help="the first fitted run's seed (the held-out run's: the one after the fitted runs'); keep them off"
        " validate's --bench-seed",
    )
    parser.add_argument(
        "--program-runs",
        type=int,
        default=1,
        help="with --workloads: fitted runs of each workload (seeds from --workload-seed), each on a fresh engine as"
        " validate's repeats are; the held-out run's seed is the next",
    )
    parser.add_argument(
        "--num-programs", type=positive_int, default=8, help="with --workloads: programs of each workload"
    )
    parser.add_argument("--rate", type=non_negative_float, default=0.25, help="with --workloads: programs per second")
    parser.add_argument("--scale", type=positive_float, default=0.1, help="with --workloads: as validate's --scale")
    parser.add_argument(
        "--tool-wait", type=non_negative_float, default=0.2, help="with --workloads: as validate's --tool-wait"
    )
    parser.add_argument(
        "--refit",
        metavar="PROFILE",
        help="measure nothing: fit this profile's kept steps again (--form, --per-shape) and print its errors",
    )
    parser.add_argument(
        "--per-shape",
        choices=sorted(PER_SHAPE),
        help="with --refit: which steps to fit (default: all for a served profile, else fastest)",
    )
    parser.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="VALIDATE_JSON",
        help="with --refit: the real steps of a `simulate validate --json` run on as many instances, measured against"
        " the profile before and after the refit, by step class",
    )
