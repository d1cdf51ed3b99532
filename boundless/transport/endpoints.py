"""Opening an endpoint of any implementation, and finding the peers' addresses through a directory.

The instances of a cluster get their peers' addresses from the control plane (Ray); tests and benchmarks,
whose processes share a node, use a rendezvous directory instead: each endpoint writes its address to
``<dir>/<rank>.addr`` and reads the others'. The libraries of the field are optional: an implementation
whose package is missing raises :class:`TransportUnavailable` with the reason when opened.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from boundless.transport.base import KVTransport, TransferTimeout

KINDS = ("gloo", "shm", "nixl", "mooncake")


class TransportUnavailable(RuntimeError):
    """The implementation cannot run here (its package is missing, or it failed to start)."""


@dataclass(frozen=True)
class EndpointSpec:
    """One endpoint of a world of ``world_size`` on one node, meeting its peers in ``directory``."""

    kind: str
    directory: str
    rank: int
    world_size: int
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown transport {self.kind!r}; one of {', '.join(KINDS)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")


# A model split over tensor-parallel ranks moves KV rank to rank: each rank has an endpoint of its own, and the
# instance's address is its ranks' addresses, rank 0's first, one a line (no transport's address holds a newline).
_RANK_SEPARATOR = "\n"


def instance_address(rank_addresses: Sequence[str]) -> str:
    """The address peers know an instance by, made of its ranks' endpoints' addresses (one endpoint: its own)."""
    if any(_RANK_SEPARATOR in a for a in rank_addresses):
        raise ValueError("an endpoint's address holds a newline")
    return _RANK_SEPARATOR.join(rank_addresses)


def rank_address(address: str, rank: int) -> str:
    """The address of rank ``rank``'s endpoint in an instance's ``address`` (:func:`instance_address`)."""
    parts = address.split(_RANK_SEPARATOR)
    if rank >= len(parts):
        raise ValueError(f"the peer at {parts[0]!r} has {len(parts)} ranks, not rank {rank}: split it as this one")
    return parts[rank]


def open_endpoint(spec: EndpointSpec) -> KVTransport:
    """The endpoint ``spec`` describes (the gloo group's constructor waits for every rank to join)."""
    Path(spec.directory).mkdir(parents=True, exist_ok=True)
    if spec.kind == "gloo":
        import torch.distributed as dist

        from boundless.transport.torch_dist import TorchDistTransport

        store = dist.FileStore(os.path.join(spec.directory, "gloo.store"), spec.world_size)
        store.set_timeout(datetime.timedelta(seconds=spec.timeout_s))  # a rank that never joins: an error
        return TorchDistTransport(store, spec.rank, spec.world_size, "gloo", timeout_s=spec.timeout_s)
    if spec.kind == "shm":
        from boundless.transport.shm import ShmTransport

        return ShmTransport(spec.directory, f"rank{spec.rank}", timeout_s=spec.timeout_s)
    if spec.kind == "nixl":
        from boundless.transport.nixl import NixlTransport

        return NixlTransport(f"rank{spec.rank}", timeout_s=spec.timeout_s)
    from boundless.transport.mooncake import MooncakeTransport

    return MooncakeTransport(timeout_s=spec.timeout_s)


def exchange_addresses(spec: EndpointSpec, transport: KVTransport) -> list[str]:
    """Publish this endpoint's address and return every rank's, by rank (waits up to ``spec.timeout_s``)."""
    directory = Path(spec.directory)
    mine = directory / f"{spec.rank}.addr"
    tmp = mine.with_suffix(".tmp")
    tmp.write_text(transport.address)
    tmp.rename(mine)  # atomic: a reader sees the whole address or nothing
    deadline = time.monotonic() + spec.timeout_s
    addresses: list[str] = []
    for rank in range(spec.world_size):
        path = directory / f"{rank}.addr"
        while not path.exists():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {rank} did not publish its address in {spec.timeout_s:g} s")
            time.sleep(0.005)
        addresses.append(path.read_text())
    return addresses
