"""CPU seconds per MB of each stage a DE-read costs on this machine: an experiment behind docs/disaggregation.md.

    python scripts/kv_io_cost.py [--blocks 64] [--rounds 3]

On SmolLM2-135M-shaped float32 blocks (720 KiB each) in the page cache, with the real parts:

- ``store read (old)``: the disk store's ``read`` (a fresh tensor per block, checksums), the loader's ``stack``
  and its copy into host blocks: what the engine's loader did behind an emulated storage link before;
- ``store read_into``: the store reading into the loader's reused buffer and one copy into host blocks (the path
  it takes now, and always took without a link);
- ``crc32``: the payload checksum alone;
- ``push over shm``: a DE's ``RemoteIO`` sending the blocks from its host memory to a PE's ``RemoteIO`` over the
  shared-memory transport, layer by layer (gather, the transport's copies, the PE's copy into its host blocks),
  until the PE has them all.

Prints, per stage, the median over rounds of the process's CPU seconds (every thread: the store's I/O threads,
the transport's) and wall seconds per MB (10^6 bytes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from boundless.kv.block_file import payload_view
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.kv.remote_io import RemoteIO
from boundless.kv.remote_moves import RemoteRecv, RemoteSend
from boundless.kv.tensors import PagedKVCache
from boundless.kv.tiers import HostKVTier
from boundless.kv.transfer import DEVICE, HOST, BlockRef
from boundless.transport.shm import ShmTransport

LAYOUT = StoreLayout("io-cost", 30, 3, 16, 64, torch.float32)


def _tiers(n: int) -> dict:
    device = PagedKVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 4, LAYOUT.block_size,
                          torch.float32, torch.device("cpu"))  # fmt: skip
    return {DEVICE: device, HOST: HostKVTier(device, n)}


def _cost(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.blocks
    root = Path(tempfile.mkdtemp(prefix="kv-io-cost-"))
    try:
        store = DiskKVStore(root / "store", LAYOUT, 1 << 40)
        keys = [i.to_bytes(16, "big") for i in range(n)]
        blocks = torch.randn((n, *LAYOUT.block_shape))
        store.write(keys, blocks.permute(1, 2, 3, 0, 4, 5).contiguous())
        mb = n * LAYOUT.file_spec().payload_bytes / 1e6
        host = _tiers(n)[HOST]
        staging = torch.empty((n, *LAYOUT.block_shape))
        ids = list(range(n))

        def read_old() -> None:
            got = store.read(keys)
            host.write_blocks(ids, torch.stack(got, dim=3))  # type: ignore[arg-type]

        def read_into() -> None:
            assert all(store.read_into(keys, staging))
            host.write_blocks(ids, staging.permute(1, 2, 3, 0, 4, 5))

        def crc() -> None:
            for i in range(n):
                zlib.crc32(payload_view(staging[i]))

        read_into()
        assert torch.equal(host.read_blocks([0])[:, :, :, 0], blocks[0])  # what was stored came back
        stages: dict[str, Callable[[], None]] = {"store read (old)": read_old, "store read_into": read_into,
                                                 "crc32": crc}  # fmt: skip

        shm = root / "shm"
        de_net, pe_net = ShmTransport(shm, "de"), ShmTransport(shm, "pe")
        de_tiers, pe_tiers = _tiers(n), _tiers(n)
        de_tiers[HOST].write_blocks(ids, staging.permute(1, 2, 3, 0, 4, 5))
        de_io, pe_io = RemoteIO(de_tiers, de_net), RemoteIO(pe_tiers, pe_net)
        tags = iter(range(1, 1 << 30))

        def push() -> None:
            tag = next(tags)
            pe_io.start([RemoteRecv(tag, de_net.address, tag, tuple(ids), n)], [])
            de_io.start([], [RemoteSend(tag, pe_net.address, tag, tuple(BlockRef(HOST, i) for i in ids), n)])
            got: list = []
            while not got:
                got = list(pe_io.report(wait_s=0.5).recvs)
            assert got[0].num_valid == n, got
            de_io.report()

        stages["push over shm"] = push
        try:
            for name, fn in stages.items():
                fn()  # warm
                cpu, wall = _cost(fn, args.rounds)
                print(f"{name:18s} {mb:6.1f} MB: CPU {cpu / mb * 1e3:6.2f} ms/MB, wall {wall / mb * 1e3:6.2f} ms/MB "
                      f"({mb / wall:6.0f} MB/s)", flush=True)  # fmt: skip
            assert torch.equal(pe_tiers[HOST].read_blocks([n - 1])[:, :, :, 0], blocks[n - 1])
        finally:
            de_io.close()
            pe_io.close()
            de_net.close()
            pe_net.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
