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
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from boundless.bench.programs import served_engine
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, ChunkShape, fit_attention_time
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel, load_model
from boundless.sim.cost import (
    DISK_LATENCY_S,
    DISK_READ_BYTES_PER_S,
    DISK_WRITE_BYTES_PER_S,
    HOST_COPY_BYTES_PER_S,
)
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import fitted_profile_dict
from boundless.sim.served_grid import MODEL_NAME, run_served_grid

# A step slower than this many times the fit's prediction was slowed by something else (as perf_model's).
OUTLIER_FACTOR = 1.5


@dataclass(frozen=True)
class CalibrationGrid:
    """The batch shapes to run: every number of requests with every prompt length, ``output_tokens`` each,
    the whole grid ``repeats`` times."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    prompt_lens: tuple[int, ...] = (16, 128, 512, 1024)
    output_tokens: int = 8
    repeats: int = 3


# Shapes the fit never sees, between and beside the default grid's, to measure its error on.
HELD_OUT_GRID = CalibrationGrid((3, 6), (64, 384, 768), output_tokens=6, repeats=3)


@dataclass(frozen=True)
class FitError:
    """Relative errors of a model's predictions over a set of step shapes."""

    steps: int
    median: float
    p90: float
    worst: float


@dataclass(frozen=True)
class Calibration:
    model: AttentionTimeModel
    samples: list[AttentionSample]  # every measured step, all repeats
    held_out: list[AttentionSample]  # every measured step of the held-out grid
    fit_error: FitError  # on the fastest time of each fitted shape
    held_out_error: FitError | None  # on the fastest time of each held-out shape
    wall_s: float
    per_shape: str = "fastest"  # which time of each shape the fit and its errors take: fastest or median


def run_grid(core: EngineCore, grid: CalibrationGrid, seed: int = 0) -> list[AttentionSample]:
    """Run every shape of ``grid`` on ``core`` to the end, ``grid.repeats`` times; the steps it recorded.

    Prompt lengths, not contents, decide the scheduler's steps, so every repeat runs the same step shapes."""
    rng = random.Random(seed)
    vocab = core.identity.vocab_size
    ids = itertools.count()
    params = SamplingParams(max_tokens=grid.output_tokens, ignore_eos=True)
    core.step_times.drain()
    samples: list[AttentionSample] = []
    for _, batch, prompt_len in itertools.product(range(grid.repeats), grid.batch_sizes, grid.prompt_lens):
        for _ in range(batch):  # random prompts: no prefix-cache hits between them
            core.add_request(f"cal{next(ids)}", [rng.randrange(100, vocab) for _ in range(prompt_len)], params)
        while core.has_unfinished():
            core.step()
        samples += core.step_times.drain()
        core.reset_prefix_cache()
    return samples


def step_shape(sample: AttentionSample) -> tuple[ChunkShape, ...]:
    """A step's chunk shapes in a fixed order: the same batch in another order costs the same."""
    return tuple(sorted(sample.shapes, key=lambda c: (c.cached, c.new)))


def fastest_per_shape(samples: Sequence[AttentionSample]) -> list[AttentionSample]:
    """Each distinct step shape once, with its fastest measured time (in first-seen order).

    Contention only adds time, so the minimum over repeats is the closest to what the shape itself costs."""
    best: dict[tuple[ChunkShape, ...], float] = {}
    for s in samples:
        shape = step_shape(s)
        best[shape] = min(best.get(shape, s.seconds), s.seconds)
    return [AttentionSample(shapes, seconds) for shapes, seconds in best.items()]


def median_per_shape(samples: Sequence[AttentionSample]) -> list[AttentionSample]:
    """Each distinct step shape once, with the median of its measured times (in first-seen order).

    For a served engine: what serving adds to a step is there in every pass, a burst of outside load in one."""
    times: dict[tuple[ChunkShape, ...], list[float]] = {}
    for s in samples:
        times.setdefault(step_shape(s), []).append(s.seconds)
    return [AttentionSample(shapes, statistics.median(seconds)) for shapes, seconds in times.items()]


PerShape = Callable[[Sequence[AttentionSample]], list[AttentionSample]]
PER_SHAPE: dict[str, PerShape] = {"fastest": fastest_per_shape, "median": median_per_shape}


def fit_step_model(samples: Sequence[AttentionSample], per_shape: str = "fastest") -> AttentionTimeModel:
    """The engine's per-term fit on each shape's fastest (or median) time, in relative error, without the shapes
    still slowed by something other than their shape."""
    return fit_attention_time(PER_SHAPE[per_shape](samples), relative=True, outlier_factor=OUTLIER_FACTOR)


def relative_errors(model: AttentionTimeModel, samples: Sequence[AttentionSample]) -> list[float]:
    return [(model.predict(s.shapes) - s.seconds) / s.seconds for s in samples if s.seconds > 0]


def fit_error(model: AttentionTimeModel, samples: Sequence[AttentionSample], per_shape: str = "fastest") -> FitError:
    """The model's relative errors on each shape's fastest (or median) time."""
    errors = sorted(abs(e) for e in relative_errors(model, PER_SHAPE[per_shape](samples)))
    return FitError(len(errors), statistics.median(errors), errors[int(0.9 * (len(errors) - 1))], errors[-1])


def median_rel_error(model: AttentionTimeModel, samples: Sequence[AttentionSample]) -> float:
    return fit_error(model, samples).median


def calibrate(
    loaded: LoadedModel, config: EngineConfig, grid: CalibrationGrid, held_out: CalibrationGrid | None = None
) -> Calibration:
    core = EngineCore.from_model(loaded, config)
    start = time.monotonic()
    run_grid(core, CalibrationGrid((1,), (32,), 2, 1))  # warm-up: first calls allocate and compile
    samples = run_grid(core, grid)
    held = run_grid(core, held_out, seed=1) if held_out is not None else []
    return fitted(samples, held, time.monotonic() - start, "fastest")


def calibrate_served(
    loaded: LoadedModel,
    config: EngineConfig,
    grid: CalibrationGrid,
    held_out: CalibrationGrid | None = None,
    cluster: ClusterConfig | None = None,
) -> Calibration:
    """The grids through a served engine (or cluster), fitted on each shape's median time."""
    vocab = loaded.arch.vocab_size
    with served_engine(loaded, config, cluster, model_name=MODEL_NAME) as served:
        start = time.monotonic()
        run_served_grid(served, CalibrationGrid((1,), (32,), 2, 1), vocab, seed=2)  # warm-up, not kept
        samples = run_served_grid(served, grid, vocab)
        held = run_served_grid(served, held_out, vocab, seed=1) if held_out is not None else []
        wall = time.monotonic() - start
    return fitted(samples, held, wall, "median")


def fitted(samples: list[AttentionSample], held: list[AttentionSample], wall_s: float, per_shape: str) -> Calibration:
    """The fit of the grid's steps, and its errors on them and on the held-out grid's."""
    model = fit_step_model(samples, per_shape)
    held_error = fit_error(model, held, per_shape) if held else None
    return Calibration(model, samples, held, fit_error(model, samples, per_shape), held_error, wall_s, per_shape)


def _grid(batch_sizes: str, prompt_lens: str, output_tokens: int, repeats: int) -> CalibrationGrid:
    return CalibrationGrid(
        tuple(int(b) for b in batch_sizes.split(",")),
        tuple(int(p) for p in prompt_lens.split(",")),
        output_tokens,
        repeats,
    )


def _grid_text(grid: CalibrationGrid) -> str:
    return (
        f"batch sizes {grid.batch_sizes} x prompt lengths {grid.prompt_lens}, {grid.output_tokens} output tokens,"
        f" {grid.repeats} repeats"
    )


def _error_text(e: FitError | None) -> str:
    if e is None:
        return "none"
    return f"median {e.median:.1%}, p90 {e.p90:.1%}, worst {e.worst:.1%} over {e.steps} shapes"


def _samples_json(samples: Sequence[AttentionSample]) -> list:
    """The measured steps, to refit or inspect: [[cached, new] per request], seconds."""
    return [[[[c.cached, c.new] for c in s.shapes], s.seconds] for s in samples]


def samples_from_json(rows: Sequence) -> list[AttentionSample]:
    """The steps a profile's ``calibration`` keeps, back as samples (to refit offline)."""
    return [AttentionSample(tuple(ChunkShape(c, n) for c, n in shapes), seconds) for shapes, seconds in rows]


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


def run(args: argparse.Namespace) -> dict:
    grid = _grid(args.batch_sizes, args.prompt_lens, args.output_tokens, args.repeats)
    held_out = (
        _grid(args.held_out_batch_sizes, args.held_out_prompt_lens, HELD_OUT_GRID.output_tokens, args.repeats)
        if args.held_out_batch_sizes
        else None
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    cluster = ClusterConfig(instances=args.instances) if args.instances > 1 else None
    if cluster is not None:  # each actor runs torch on its share of the cores (ClusterClient's rule)
        threads = max(1, len(os.sched_getaffinity(0)) // args.instances)
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
    )
    loaded = load_model(config.model.model, dtype=config.model.dtype)
    load_before = os.getloadavg()[0]
    if args.served:
        result = calibrate_served(loaded, config, grid, held_out, cluster)
    else:
        if cluster is not None:
            raise SystemExit("--instances above 1 needs --served (a cluster is calibrated as it is served)")
        result = calibrate(loaded, config, grid, held_out)
    load_after = os.getloadavg()[0]
    m = result.model
    how = (
        f"served ({args.instances} instance{'s' if args.instances > 1 else ''} behind the HTTP server, the openai"
        " client)"
        if args.served
        else "the engine stepped alone"
    )
    print(
        f"{len(result.samples)} + {len(result.held_out)} held-out steps in {result.wall_s:.0f} s on {threads} threads,"
        f" {how} (load average {load_before:.1f} before, {load_after:.1f} after)"
    )
    print(f"fit on the {result.per_shape} of each shape: {_error_text(result.fit_error)}")
    print(f"held-out shapes: {_error_text(result.held_out_error)}")
    print(
        f"base {m.base_s * 1e3:.2f} ms, per request {m.per_seq_s * 1e3:.3f} ms,"
        f" per new token {m.per_token_s * 1e3:.3f} ms, per cached token {m.per_cached_s * 1e6:.3f} us,"
        f" per query-key pair {m.per_pair_s * 1e9:.3f} ns"
    )
    links = {
        "host_copy": LinkSpec(HOST_COPY_BYTES_PER_S),
        "storage_read": LinkSpec(DISK_READ_BYTES_PER_S, DISK_LATENCY_S),
        "storage_write": LinkSpec(DISK_WRITE_BYTES_PER_S, DISK_LATENCY_S),
        "network": LinkSpec(args.net_gbytes_per_s * 1e9, 5e-5),
    }
    sources = {
        "step": f"boundless simulate calibrate on this machine ({os.cpu_count()} cores, torch on {threads} threads):"
        f" {args.model} {args.dtype}, {how}, {_grid_text(grid)}, the {result.per_shape} of each step shape;"
        f" held-out shapes: {_error_text(result.held_out_error)}",
        "host_copy": "sim/cost.py HOST_COPY_BYTES_PER_S: HostSwapSpace copies measured at 10-14 GB/s on this machine",
        "storage": "sim/cost.py DISK_*: a local NVMe drive's sequential bandwidths, not measured",
        "network": "assumption: shared-memory transport between processes on one machine; not measured",
    }
    description = (
        f"{args.model} {args.dtype} on this machine's CPU ({os.cpu_count()} cores, torch on {threads} threads"
        f"{' per instance' if cluster else ''}), {how}"
    )
    data = fitted_profile_dict(args.name, description, m, links, sources)
    data["calibration"] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "served": args.served,
        "instances": args.instances,
        "per_shape": result.per_shape,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "grid": _grid_text(grid),
        "held_out_grid": _grid_text(held_out) if held_out else None,
        "steps": len(result.samples),
        "fit_error": vars(result.fit_error),
        "held_out_error": vars(result.held_out_error) if result.held_out_error else None,
        "median_rel_error": result.fit_error.median,
        "wall_s": result.wall_s,
        "samples": _samples_json(result.samples),
        "held_out_samples": _samples_json(result.held_out),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_json(data))
    print(f"wrote {out}")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = CalibrationGrid()
    parser.add_argument("--out", default="cpu-profile.json", help="where to write the profile")
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--model", default=ModelConfig.model)
    parser.add_argument("--dtype", default=ModelConfig.dtype)
    parser.add_argument("--batch-sizes", default=",".join(map(str, default.batch_sizes)))
    parser.add_argument("--prompt-lens", default=",".join(map(str, default.prompt_lens)))
    parser.add_argument("--output-tokens", type=int, default=default.output_tokens)
    parser.add_argument(
        "--repeats", type=int, default=default.repeats, help="passes over the grid; the fit takes each shape's fastest"
    )
    parser.add_argument(
        "--held-out-batch-sizes",
        default=",".join(map(str, HELD_OUT_GRID.batch_sizes)),
        help="batch sizes of the held-out grid the fit is checked on ('' for none)",
    )
    parser.add_argument("--held-out-prompt-lens", default=",".join(map(str, HELD_OUT_GRID.prompt_lens)))
    parser.add_argument(
        "--threads",
        type=int,
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
        type=int,
        default=1,
        help="with --served: a Ray cluster of this many instances behind the dispatcher (as serve --instances)",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    # Below the longest prompt: long prompts run in chunks over cached context, which tells the per-pair
    # term from the per-token one.
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--net-gbytes-per-s", type=float, default=5.0)
