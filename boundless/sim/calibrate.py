"""``boundless simulate calibrate``: fit this machine's step model from the real engine, write a profile.

The real engine runs batches over a small grid of shapes (requests per batch x prompt length, a few
output tokens each, so the steps are prefills, chunked prefills over cached context, and decodes over
contexts of each length). The engine records every step's shapes and seconds itself
(``EngineCore.step_times``); the fit is the engine's own (``fit_attention_time``), in relative error so
the short decode steps weigh as much as the long prefills, without the steps slowed by something
other than their shape (another process on the cores).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import dataclass

from boundless.bench.report import write_json
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, fit_attention_time
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

# A step slower than this many times the fit's prediction was slowed by something else (as perf_model's).
OUTLIER_FACTOR = 1.5


@dataclass(frozen=True)
class CalibrationGrid:
    """The batch shapes to run: every number of requests with every prompt length, ``output_tokens`` each."""

    batch_sizes: tuple[int, ...] = (1, 4, 16)
    prompt_lens: tuple[int, ...] = (32, 256, 1024)
    output_tokens: int = 8
    repeats: int = 1


@dataclass(frozen=True)
class Calibration:
    model: AttentionTimeModel
    samples: list[AttentionSample]
    median_rel_error: float
    wall_s: float


def run_grid(core: EngineCore, grid: CalibrationGrid, seed: int = 0) -> list[AttentionSample]:
    """Run every shape of ``grid`` on ``core`` to the end; the steps it recorded."""
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


def calibrate(loaded: LoadedModel, config: EngineConfig, grid: CalibrationGrid) -> Calibration:
    core = EngineCore.from_model(loaded, config)
    start = time.monotonic()
    run_grid(core, CalibrationGrid((1,), (32,), 2))  # warm-up: first calls allocate and compile
    samples = run_grid(core, grid)
    wall = time.monotonic() - start
    model = fit_step_model(samples)
    return Calibration(model, samples, median_rel_error(model, samples), wall)


def fit_step_model(samples: list[AttentionSample]) -> AttentionTimeModel:
    """The engine's per-term fit, in relative error, without steps slowed by something other than their shape."""
    return fit_attention_time(samples, relative=True, outlier_factor=OUTLIER_FACTOR)


def median_rel_error(model: AttentionTimeModel, samples: list[AttentionSample]) -> float:
    return statistics.median(abs(model.predict(s.shapes) - s.seconds) / s.seconds for s in samples if s.seconds > 0)


def run(args: argparse.Namespace) -> dict:
    grid = CalibrationGrid(
        tuple(int(b) for b in args.batch_sizes.split(",")),
        tuple(int(p) for p in args.prompt_lens.split(",")),
        args.output_tokens,
        args.repeats,
    )
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
    )
    loaded = load_model(config.model.model, dtype=config.model.dtype)
    result = calibrate(loaded, config, grid)
    m = result.model
    print(f"{len(result.samples)} steps in {result.wall_s:.0f} s; median relative error {result.median_rel_error:.1%}")
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
    grid_text = f"batch sizes {grid.batch_sizes}, prompt lengths {grid.prompt_lens}, {grid.output_tokens} output tokens"
    sources = {
        "step": f"boundless simulate calibrate on this machine: {args.model} {args.dtype}, {grid_text}; "
        f"{len(result.samples)} steps, median relative error {result.median_rel_error:.1%}",
        "host_copy": "sim/cost.py HOST_COPY_BYTES_PER_S: HostSwapSpace copies measured at 10-14 GB/s on this machine",
        "storage": "sim/cost.py DISK_*: a local NVMe drive's sequential bandwidths, not measured",
        "network": "assumption: shared-memory transport between processes on one machine; not measured",
    }
    data = fitted_profile_dict(args.name, f"{args.model} {args.dtype} on this machine's CPU", m, links, sources)
    data["calibration"] = {
        "steps": len(result.samples),
        "median_rel_error": result.median_rel_error,
        "wall_s": result.wall_s,
        # The measured steps, to refit or inspect: [[cached, new] per request], seconds.
        "samples": [[[[c.cached, c.new] for c in s.shapes], s.seconds] for s in result.samples],
    }
    write_json(args.out, data)
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="cpu-profile.json", help="where to write the profile")
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--model", default=ModelConfig.model)
    parser.add_argument("--dtype", default=ModelConfig.dtype)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompt-lens", default="32,256,1024")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    # Below the longest prompt: long prompts run in chunks over cached context, which tells the per-pair
    # term from the per-token one.
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--net-gbytes-per-s", type=float, default=5.0)
