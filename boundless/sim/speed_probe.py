"""The machine's speed now against a calibration's: a small fixed grid on a fresh bare engine, timed.

This machine is shared, and it steps the same shapes at a level that moves by up to ~1.4x from one quarter-hour (or
process) to the next (docs/simulation.md, Validation). A profile fitted at one level predicts latencies at another
wrong by about as much, whatever the simulator does with its steps. So ``calibrate`` times this probe beside its
runs and keeps the readings in the profile (``calibration.probe_s``), and ``validate`` times it before and after
each real run. The ratio of the two medians is the machine's speed then against the calibration's, from shapes fixed
here (none of the validated programs'), and validate predicts each case a second time at that speed: the profile's
step times times the ratio.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine.core import EngineCore
from boundless.sim.grid import WARM_UP_GRID, CalibrationGrid, median_per_shape, run_grid
from boundless.sim.profiles import FittedStepCost, HardwareProfile

if TYPE_CHECKING:
    from boundless.model.loader import LoadedModel

# Decodes of 1, 2 and 4 over a few hundred cached tokens (most of a served program's steps) and their prefills,
# three passes (a burst of outside load in one moves no shape's median): about 150 steps, ~9 s on this machine.
PROBE_GRID = CalibrationGrid((1, 2, 4), (256,), output_tokens=16, repeats=3)
# The probe's own pool: its largest batch holds 4 x 280 tokens (72 blocks); a small pool is made in no time.
PROBE_KV_BLOCKS = 128


def probe_seconds(loaded: LoadedModel, model: ModelConfig, threads: int) -> float:
    """The probe grid's seconds on a fresh bare engine of ``model`` with the engine's default flags (whatever the
    calibration's or validate's, so that every reading runs the same steps) and its own small KV pool, torch on
    ``threads``: the sum over the grid's step shapes of each shape's median over its passes."""
    config = EngineConfig(model=model, cache=CacheConfig(num_kv_blocks=PROBE_KV_BLOCKS, kv_host_gb=0.0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        core = EngineCore.from_model(loaded, config)
        run_grid(core, WARM_UP_GRID)
        samples = run_grid(core, PROBE_GRID)
    finally:
        torch.set_num_threads(before)
    return sum(s.seconds for s in median_per_shape(samples))


def speed_ratio(readings: Sequence[float], reference: Sequence[float]) -> float:
    """The probe's median time now over its median in the calibration: above 1, the machine steps slower now."""
    return statistics.median(readings) / statistics.median(reference)


def at_speed(profile: HardwareProfile, ratio: float) -> HardwareProfile:
    """``profile`` with every step taking ``ratio`` times its time (a fitted profile's links are left as they are)."""
    if not isinstance(profile.step, FittedStepCost):
        raise ValueError(f"profile {profile.name!r}: only a fitted step model is probed and scaled")
    return dataclasses.replace(profile, step=FittedStepCost(profile.step.model.scaled(ratio)))
