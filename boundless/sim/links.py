"""What a simulated copy or read costs: a link's bandwidth and its latency per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """A resource bytes cross: ``bytes_per_s`` after ``latency_s`` per request."""

    bytes_per_s: float
    latency_s: float = 0.0
