"""Timing a piece of device work."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def device_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after a warm-up: by CUDA events on a GPU (the device's time, not the launch's), by
    the wall clock elsewhere."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begun = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begun)
    return sorted(times)[len(times) // 2]
