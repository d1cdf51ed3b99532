"""Timing a piece of device work."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

# Cycles the GPU sleeps before each timed run (~10 ms on an H200), while the host queues the run's calls: the events
# then time the device's work, not the host's launches (a decode's attention takes less than its launches).
_HEAD_START_CYCLES = 20_000_000


def device_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` after a warm-up, each repeat timing ``inner`` calls back to back: by CUDA
    events on a GPU (the device's time, with the calls queued behind a sleep of the GPU's), by the wall clock
    elsewhere."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_HEAD_START_CYCLES)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            begun = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - begun) / inner)
    return sorted(times)[len(times) // 2]
