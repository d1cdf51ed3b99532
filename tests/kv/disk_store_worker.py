"""A second process on the disk KV store, for tests/kv/test_disk_store.py (run as a script).

    write ROOT N [--barrier DIR --peers K]   write blocks 0..N-1; with a barrier, every writer pauses halfway
                                             through its first file until K writers are there
    pause ROOT                               write block 0, pausing halfway forever (the test kills it)
    churn ROOT N ROUNDS CAPACITY_BLOCKS      write blocks 0..N-1 ROUNDS times into a small store (evicting)
    refused ROOT N                           writes under a 1 KiB file-size limit, then without it
    fill ROOT N                              N blocks, 4 per call, into whatever room the directory has
    refill ROOT N                            blocks one a call until the disk is full, then N more after the pause

Prints one JSON line of results on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch

from boundless.kv.disk_store import DiskKVStore, StoreLayout

LAYOUT = StoreLayout("test-model", num_layers=2, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.float32)
BIG = 1 << 40


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"block {i}".encode(), digest_size=16).digest()


def block_of(i: int, layout: StoreLayout = LAYOUT) -> torch.Tensor:
    """Block ``i``'s KV [layers, 2, kv_heads, block_size, head_dim]: every element differs from every other
    block's, so a torn or mixed-up block cannot pass for it."""
    numel = 1
    for d in layout.block_shape:
        numel *= d
    return (torch.arange(numel, dtype=torch.float64) + i * numel).to(layout.dtype).view(layout.block_shape)


def blocks_of(ids: list[int], layout: StoreLayout = LAYOUT) -> torch.Tensor:
    """[layers, 2, kv_heads, n, block_size, head_dim], as the KV cache hands blocks over."""
    return torch.stack([block_of(i, layout) for i in ids], dim=3)


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _barrier(directory: Path, peers: int) -> None:
    """Wait (up to 20 s) until ``peers`` processes have reached this point."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(os.getpid())).touch()
    deadline = time.monotonic() + 20
    while len(list(directory.iterdir())) < peers and time.monotonic() < deadline:
        time.sleep(0.005)


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("root")
    parser.add_argument("n", type=int, nargs="?", default=1)
    parser.add_argument("rounds", type=int, nargs="?", default=1)
    parser.add_argument("capacity_blocks", type=int, nargs="?", default=0)
    parser.add_argument("--barrier")
    parser.add_argument("--peers", type=int, default=2)
    args = parser.parse_args()
    ids = list(range(args.n))
    keys = [key_of(i) for i in ids]
    out: dict = {}

    if args.mode == "write":
        paused = []

        def wait_for_peers(_tmp: Path) -> None:
            if not paused:
                paused.append(True)
                _barrier(Path(args.barrier), args.peers)

        # One I/O thread: the barrier then holds each writer inside block 0, the same block.
        hook = wait_for_peers if args.barrier else None
        store = DiskKVStore(args.root, LAYOUT, BIG, io_threads=1, mid_write=hook)
        out["stored"] = store.write(keys, blocks_of(ids))
    elif args.mode == "pause":

        def hang(tmp: Path) -> None:
            print(json.dumps({"paused": str(tmp)}), flush=True)
            time.sleep(600)

        DiskKVStore(args.root, LAYOUT, BIG, mid_write=hang).write(keys[:1], blocks_of([0]))
    elif args.mode == "churn":
        capacity = args.capacity_blocks * LAYOUT.file_spec().file_bytes
        store = DiskKVStore(args.root, LAYOUT, capacity, rescan_seconds=0.0)
        print(json.dumps({"started": True}), flush=True)
        for _ in range(args.rounds):
            for i in ids:
                store.write([keys[i]], blocks_of([i]))
        out["evictions"] = store.stats().evictions
    elif args.mode == "refused":
        # The kernel refuses every write past 1 KiB of a file (EFBIG; the signal it would also send is ignored).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        clock = FakeClock()
        # One I/O thread: a call's blocks fail or are dropped in order, so the counts below are exact.
        store = DiskKVStore(args.root, LAYOUT, BIG, clock=clock, write_off_seconds=60, io_threads=1)
        out["read_before"] = [
            b is not None and bool(torch.equal(b, block_of(i))) for i, b in enumerate(store.read(keys))
        ]
        new = [args.n, args.n + 1]
        new_keys = [key_of(i) for i in new]
        out["refused"] = store.write(new_keys, blocks_of(new))
        out["while_off"] = store.write(new_keys, blocks_of(new))
        out["enabled_while_off"] = store.stats().writes_enabled
        clock.now += 61
        out["refused_again"] = store.write(new_keys, blocks_of(new))
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        clock.now += 61
        out["after_limit_lifted"] = store.write(new_keys, blocks_of(new))
        out["read_after"] = [b is not None for b in store.read(new_keys)]
        out["stats"] = store.stats().__dict__
    elif args.mode == "fill":
        store = DiskKVStore(args.root, LAYOUT, BIG)
        out["stored"] = [store.write(keys[i : i + 4], blocks_of(ids[i : i + 4])) for i in range(0, args.n, 4)]
        read = store.read(keys)
        out["valid"] = [b is not None and bool(torch.equal(b, block_of(i))) for i, b in enumerate(read)]
        out["temp_files"] = len(list(Path(args.root).rglob("*.tmp")))
        out["stats"] = store.stats().__dict__
    elif args.mode == "refill":
        clock = FakeClock()
        store = DiskKVStore(args.root, LAYOUT, BIG, clock=clock, io_threads=1)
        i = 0
        while store.write([key_of(i)], blocks_of([i])) == 1:  # until the file system refuses one
            i += 1
            clock.now += 1  # (each block stamped later than the last: block 0 is the least recently used)
        out["held_when_full"] = i
        clock.now += 61  # past the pause
        new = list(range(i, i + args.n))
        out["stored_after"] = [store.write([key_of(j)], blocks_of([j])) for j in new]
        read = store.read([key_of(j) for j in range(i + args.n)])
        out["valid"] = [b is not None and bool(torch.equal(b, block_of(j))) for j, b in enumerate(read)]
        out["stats"] = store.stats().__dict__
    else:
        raise SystemExit(f"unknown mode {args.mode!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
