"""What an instance's KV lending did, as plain data for ``EngineStats`` (heartbeats, ``/metrics``, ``/cluster``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LendingStats:
    """A snapshot of one instance's lending: moves made and taken, DistAttention round trips (cumulative), and the
    blocks lent and borrowed now."""

    moves_out: int = 0  # moves of its requests' blocks to creditors, committed
    blocks_out: int = 0
    bytes_out: int = 0
    moves_in: int = 0  # moves of debtors' blocks it took
    blocks_in: int = 0
    bytes_in: int = 0
    requests_recomputed: int = 0  # requests whose blocks were lost with a creditor
    requests_held: int = 0  # requests dropped and held back by the gManager's deadlock breaker
    requests_granted: int = 0  # requests longer than the pool the gManager let start (cluster/lending_grants.py)
    requests_refused: int = 0  # requests longer than the pool the live instances could not hold, failed
    round_trips: int = 0  # partial requests it sent and got answered (as a debtor)
    round_trip_bytes: int = 0  # their bytes, both ways
    partials_served: int = 0  # partial requests it answered (as a creditor)
    remote_layers: int = 0  # layer calls with remote blocks
    exposed_wait_s: float = 0.0  # seconds those waited for creditors after their local partial was done
    blocks_lent: int = 0  # now
    blocks_borrowed: int = 0  # now

    @classmethod
    def total(cls, stats: Iterable[LendingStats]) -> LendingStats:
        """Several instances' lending as one: every field summed (the blocks lent and borrowed now, too)."""
        fields = [f.name for f in dataclasses.fields(cls)]
        sums = dict.fromkeys(fields, 0)
        for s in stats:
            for name in fields:
                sums[name] += getattr(s, name)
        return cls(**sums)
