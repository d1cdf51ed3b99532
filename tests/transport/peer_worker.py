"""The other process of tests/transport/test_two_processes.py (run as a script): rank 1 of a world of 2.

    peer_worker.py KIND DIR

1. echoes every message of ``cases.CASES`` back (received with tag 100+i, sent back with tag 200+i), then
   takes KV blocks into its cache (tag 600 + dtype index, at ``PEER_BLOCKS``) and sends them back (tag 610+);
2. waits for "go" (tag 300), then sends two messages late (tags 301 and 302, ``cases.late(...)``);
3. waits for tag 400 and exits at once, closing nothing.
"""

from __future__ import annotations

import os
import sys

import torch
from cases import CASES, KV_DTYPES, PEER_BLOCKS, kv_cache, late

from boundless.transport.blocks import BlocksReceive, send_blocks
from boundless.transport.endpoints import EndpointSpec, exchange_addresses, open_endpoint


def main(kind: str, directory: str) -> None:
    spec = EndpointSpec(kind, directory, rank=1, world_size=2, timeout_s=20.0)
    transport = open_endpoint(spec)
    peer = exchange_addresses(spec, transport)[0]
    for i, case in enumerate(CASES):
        bufs = [torch.empty(shape, dtype=dtype) for shape, dtype in case]
        transport.recv(peer, 100 + i, bufs).wait()
        transport.send(peer, 200 + i, bufs).wait()
    for j, dtype in enumerate(KV_DTYPES):
        cache = kv_cache(dtype, seed=None)
        BlocksReceive(transport, peer, 600 + j, cache, PEER_BLOCKS).wait()
        send_blocks(transport, peer, 610 + j, cache, PEER_BLOCKS).wait()
    go = torch.zeros(1, dtype=torch.int64)
    transport.recv(peer, 300, go).wait()
    transport.send(peer, 301, late(301)).wait()
    transport.send(peer, 302, late(302)).wait()
    transport.recv(peer, 400, go).wait()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
