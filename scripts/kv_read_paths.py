"""Where the disk KV store's read time goes: an experiment behind docs/kv-store.md (not a benchmark command).

    python scripts/kv_read_paths.py DIR [--blocks 1400] [--rounds 3]

In a fresh subdirectory of DIR (removed afterwards), on SmolLM2-135M-shaped float32 blocks (720 KiB files):

- cold (page cache dropped before each): one sequential file of the same size; the store's ``read`` and
  ``read_into``; the same files read plainly into reused buffers with 4 and 16 threads; and with ``O_DIRECT``
  (no page cache: one request per file straight into the buffer);
- hot (in the page cache), 256 blocks, 64 per call: ``read`` against ``read_into``, alone and followed by what
  the engine's loader does with them (into host memory laid out like the KV cache: a stack and an
  ``index_copy_``, against one ``index_copy_`` of the staging buffer).

Prints GB/s (10^9 bytes) per round.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from boundless.bench.store import _drop_page_cache
from boundless.kv.disk_store import DiskKVStore, StoreLayout

LAYOUT = StoreLayout("read-paths", 30, 3, 16, 64, torch.float32)
PER_CALL = 64


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--blocks", type=int, default=1400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir) / f"kv-read-paths-{os.getpid()}"
    n = args.blocks // PER_CALL * PER_CALL
    keys = [hashlib.blake2b(f"k{i}".encode(), digest_size=16).digest() for i in range(n)]
    store = DiskKVStore(root / "store", LAYOUT, 1 << 40)
    batch = torch.randn(30, 2, 3, PER_CALL, 16, 64)
    try:
        for i in range(0, n, PER_CALL):
            store.write(keys[i : i + PER_CALL], batch)
        files = [store._path(k) for k in keys]
        size = files[0].stat().st_size
        raw = root / "raw.bin"
        with raw.open("wb") as f:
            for _ in range(n):
                f.write(os.urandom(size))
        os.sync()
        _cold(store, keys, files, raw, size, args.rounds)
        _hot(store, keys[:256], args.rounds + 2)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _cold(store: DiskKVStore, keys: list[bytes], files: list[Path], raw: Path, size: int, rounds: int) -> None:
    local = threading.local()
    out = torch.empty((PER_CALL, *LAYOUT.block_shape))

    def buffer() -> mmap.mmap:  # page-aligned, as O_DIRECT needs
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)
        return local.buf

    def read_file(path: Path, flags: int) -> None:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            os.preadv(fd, [buffer()], 0)
        finally:
            os.close(fd)

    def files_with(threads: int, flags: int) -> None:
        with ThreadPoolExecutor(threads) as pool:
            for s in range(0, len(files), PER_CALL):
                list(pool.map(lambda p: read_file(p, flags), files[s : s + PER_CALL]))

    def sequential() -> None:
        buf = bytearray(16 << 20)
        fd = os.open(raw, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)

    def by_calls(fn: Callable[[list[bytes]], object]) -> Callable[[], None]:
        return lambda: [fn(keys[s : s + PER_CALL]) for s in range(0, len(keys), PER_CALL)]

    ways: dict[str, tuple[list[Path], Callable[[], object]]] = {
        "raw sequential file": ([raw], sequential),
        "store.read": (files, by_calls(store.read)),
        "store.read_into": (files, by_calls(lambda ks: store.read_into(ks, out))),
        "plain, 4 threads": (files, lambda: files_with(4, 0)),
        "plain, 16 threads": (files, lambda: files_with(16, 0)),
        "O_DIRECT, 4 threads": (files, lambda: files_with(4, os.O_DIRECT)),
        "O_DIRECT, 16 threads": (files, lambda: files_with(16, os.O_DIRECT)),
    }
    nbytes = len(files) * size
    for name, (paths, fn) in ways.items():
        figures = []
        for _ in range(rounds):
            _drop_page_cache(paths)
            figures.append(round(nbytes / 1e9 / _timed(fn), 2))
        print(f"cold {name:24s} {figures} GB/s", flush=True)


def _hot(store: DiskKVStore, keys: list[bytes], rounds: int) -> None:
    staging = torch.empty((PER_CALL, *LAYOUT.block_shape))
    host = torch.zeros(30, 2, 3, 4 * len(keys), 16, 64)  # a host tier: [layers, 2, heads, blocks, bs, dim]
    dst = torch.randperm(host.shape[3])[: len(keys)]

    def calls(fn: Callable[[list[bytes], torch.Tensor], None]) -> Callable[[], None]:
        return lambda: [
            fn(keys[s : s + PER_CALL], dst[s : s + PER_CALL]) for s in range(0, len(keys), PER_CALL)
        ]  # fmt: skip

    def read_stack_copy(ks: list[bytes], ids: torch.Tensor) -> None:  # the loader before read_into
        host.index_copy_(3, ids, torch.stack(store.read(ks), dim=3))

    def read_into_copy(ks: list[bytes], ids: torch.Tensor) -> None:  # the loader now
        store.read_into(ks, staging)
        host.index_copy_(3, ids, staging[: len(ks)].permute(1, 2, 3, 0, 4, 5))

    ways = {
        "store.read": calls(lambda ks, ids: store.read(ks)),
        "store.read_into": calls(lambda ks, ids: store.read_into(ks, staging)),
        "read + stack + index_copy_": calls(read_stack_copy),
        "read_into + index_copy_": calls(read_into_copy),
    }
    nbytes = len(keys) * LAYOUT.file_spec().file_bytes
    for fn in ways.values():
        fn()  # into the page cache, and the buffers touched once
    for name, fn in ways.items():
        figures = sorted(round(nbytes / 1e9 / _timed(fn), 2) for _ in range(rounds))
        print(f"hot  {name:28s} median {figures[len(figures) // 2]} of {figures} GB/s", flush=True)


if __name__ == "__main__":
    main()
