"""Public request traces (Azure LLM 2023, Mooncake FAST'25, mini-SWE-agent sessions) as arrival schedules."""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the first request
    input_len: int
    output_len: int


def _scale_len(n: int, scale: float, cap: int) -> int:
    return max(1, min(cap, round(n * scale)))


def load_trace(
    path: str | Path,
    *,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_input_len: int = 1024,
    max_output_len: int = 256,
) -> list[TraceRequest]:
    """Arrivals and lengths from a trace file (Azure ``.csv`` or Mooncake ``.jsonl``).

    ``time_scale`` < 1 compresses time (a higher rate); ``length_scale`` shrinks lengths so a
    cluster-sized trace fits a CPU; lengths are then capped.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    if path.suffix == ".csv":
        with path.open() as f:
            for rec in csv.DictReader(f):
                t = datetime.fromisoformat(rec["TIMESTAMP"][:26]).timestamp()
                rows.append((t, int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
                if max_requests and len(rows) >= max_requests:
                    break
    else:
        with path.open() as f:
            for line in f:
                rec = json.loads(line)
                rows.append((rec["timestamp"] / 1000.0, int(rec["input_length"]), int(rec["output_length"])))
                if max_requests and len(rows) >= max_requests:
                    break
    if not rows:
        raise ValueError(f"{path} holds no requests")
    t0 = rows[0][0]
    return [
        TraceRequest(
            (t - t0) * time_scale,
            _scale_len(i, length_scale, max_input_len),
            _scale_len(o, length_scale, max_output_len),
        )
        for t, i, o in rows
    ]


def poisson_schedule(
    num_requests: int, rate: float, input_len: int, output_len: int, seed: int = 0, spread: float = 0.0
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` per second; lengths uniform within ``±spread`` of the given ones."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        lo_i, hi_i = max(1, round(input_len * (1 - spread))), round(input_len * (1 + spread))
        lo_o, hi_o = max(1, round(output_len * (1 - spread))), round(output_len * (1 + spread))
        out.append(TraceRequest(t, rng.randint(lo_i, hi_i), rng.randint(lo_o, hi_o)))
    return out
