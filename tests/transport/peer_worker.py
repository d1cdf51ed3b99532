"""The other process of tests/transport/test_two_processes.py (run as a script): rank 1 of a world of 2.

    peer_worker.py KIND DIR

1. echoes every message of ``cases.CASES`` back (received with tag 100+i, sent back with tag 200+i);
2. waits for "go" (tag 300), then sends two messages late (tags 301 and 302, ``cases.late(...)``);
3. waits for tag 400 and exits at once, closing nothing.
"""

from __future__ import annotations

import os
import sys

import torch
from cases import CASES, late

from boundless.transport.endpoints import EndpointSpec, exchange_addresses, open_endpoint


def main(kind: str, directory: str) -> None:
    spec = EndpointSpec(kind, directory, rank=1, world_size=2, timeout_s=20.0)
    transport = open_endpoint(spec)
    peer = exchange_addresses(spec, transport)[0]
    for i, case in enumerate(CASES):
        bufs = [torch.empty(shape, dtype=dtype) for shape, dtype in case]
        transport.recv(peer, 100 + i, bufs).wait()
        transport.send(peer, 200 + i, bufs).wait()
    go = torch.zeros(1, dtype=torch.int64)
    transport.recv(peer, 300, go).wait()
    transport.send(peer, 301, late(301)).wait()
    transport.send(peer, 302, late(302)).wait()
    transport.recv(peer, 400, go).wait()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
