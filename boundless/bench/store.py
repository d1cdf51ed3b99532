"""``boundless bench store``: the disk KV store's speed against the raw sequential bandwidth of its directory.

On a layout shaped like SmolLM2-135M's KV (30 layers, 3 KV heads, head_dim 64; block size and dtype from
the flags), in a fresh subdirectory of ``--path`` that is removed afterwards, it measures

1. the directory's raw sequential bandwidth: one large file written in 16 MiB writes and fsynced, then
   read back after its pages are dropped from the page cache (``posix_fadvise(DONTNEED)``), and again hot
   into the same buffer;
2. the payload checksum (crc32, and blake2b for comparison) in GB/s of one core;
3. the store as built (one file per block, ``--batch-blocks`` per call, ``--io-threads``): writes into the
   page cache, then until they are on disk (``sync``), reads with the page cache dropped (cold) and hot,
   one block's read latency cold and hot, and the same files read plainly (no checks, reused buffers);
   the same with one I/O thread, and the writes with ``durable`` (an fsync per file before its rename);
4. the alternative grouping: files of ``--chunk-blocks`` blocks (256 tokens at block size 16, as LMCache),
   same format, same threads, same measures;

then prints the store's ratios to the raw bandwidth (the issue's goal is 0.7) and writes the figures to
``--json``. GB are 10^9 bytes. ``sync`` waits for every process's writes: run it on an idle machine.
Nothing is removed before the end (about 4.3 times ``--gb`` on disk at the peak): on a file system mounted
with ``discard``, space freed during a measurement is trimmed at the next journal commit, which stalls the
file creations and renames of whatever runs then, and space written right after its trim is slower.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from boundless.bench.report import output_path, print_table, write_json
from boundless.config import positive_float, positive_int
from boundless.kv.block_file import payload_view, read_block_file, write_block_file
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.model.loader import DTYPES

# SmolLM2-135M's KV shape (the bundled model): 30 layers, 3 KV heads of 64.
SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM = 30, 3, 64
_IO_CHUNK = 16 << 20
_GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory to measure (a fresh subdirectory is used)")
    parser.add_argument("--gb", type=positive_float, default=1.0, help="data written per measurement, in GiB")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="KV dtype of the layout")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--chunk-blocks", type=positive_int, default=16, help="blocks per file of the chunked alternative"
    )
    parser.add_argument("--batch-blocks", type=positive_int, default=64, help="blocks per write and read call")
    parser.add_argument("--io-threads", type=positive_int, default=4, help="the store's I/O threads")
    parser.add_argument(
        "--latency-samples", type=positive_int, default=200, help="single-block reads timed, cold and hot"
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / _GB / seconds, 3) if seconds > 0 else float("inf")


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and not p.name.endswith(".json")]


def _flush() -> None:
    """Everything written so far onto the disk: ``sync`` (one flush, as the raw file's fsync is one; it waits
    for other processes' writes too, so run the benchmark on an otherwise idle machine)."""
    os.sync()


def _drop_page_cache(paths: Iterable[Path]) -> bool:
    """Drop these (clean) files' pages from the page cache; False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_plain(files: list[Path], per_call: int, threads: int) -> None:
    size = files[0].stat().st_size
    local = threading.local()  # one reused buffer per thread

    def read(path: Path) -> None:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(size)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [local.buffer], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(files), per_call):
            list(pool.map(read, files[start : start + per_call]))


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_raw(path: Path, nbytes: int) -> dict[str, float]:
    """Sequential write (fsynced) and read (cold, then hot, into one reused buffer) of one plain file."""
    chunk = memoryview(os.urandom(_IO_CHUNK))

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, chunk[: min(left, _IO_CHUNK)])
            os.fsync(fd)
        finally:
            os.close(fd)

    buf = bytearray(_IO_CHUNK)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)

    write_s = _timed(write)
    _drop_page_cache([path])
    cold_s = _timed(read)
    hot_s = _timed(read)
    return {
        "write_gbps": _gbps(nbytes, write_s),
        "read_cold_gbps": _gbps(nbytes, cold_s),
        "read_hot_gbps": _gbps(nbytes, hot_s),
    }


def measure_checksums(nbytes: int = 64 << 20) -> dict[str, float]:
    data = memoryview(os.urandom(nbytes))
    return {
        "crc32_gbps": _gbps(nbytes, _timed(lambda: zlib.crc32(data))),
        "blake2b_gbps": _gbps(nbytes, _timed(lambda: hashlib.blake2b(data).digest())),
    }


def _keys(n: int, salt: str) -> list[bytes]:
    return [hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).digest() for i in range(n)]


def measure_store(
    directory: Path,
    layout: StoreLayout,
    batch: torch.Tensor,
    num_blocks: int,
    samples: int,
    *,
    durable: bool,
    io_threads: int,
) -> dict[str, float]:
    """The store's write (page cache, then on disk) and cold and hot read GB/s, and one block's read latency."""
    n_batch = batch.shape[3]
    keys = _keys(num_blocks, f"store-{durable}-{io_threads}")
    block_bytes = layout.file_spec().file_bytes
    nbytes = num_blocks * block_bytes
    store = DiskKVStore(directory, layout, 2 * nbytes + (1 << 30), durable=durable, io_threads=io_threads)

    def write() -> None:
        for i in range(0, num_blocks, n_batch):
            assert store.write(keys[i : i + n_batch], batch) == n_batch

    def read() -> None:
        for i in range(0, num_blocks, n_batch):
            assert all(b is not None for b in store.read(keys[i : i + n_batch]))

    out = torch.empty((n_batch, *layout.block_shape), dtype=layout.dtype)

    def read_into() -> None:  # into one reused buffer, as the engine's loader reads
        for i in range(0, num_blocks, n_batch):
            assert all(store.read_into(keys[i : i + n_batch], out))

    write_s = _timed(write)
    files = _files(store.dir)
    flush_s = _timed(_flush)
    figures = {"write_gbps": _gbps(nbytes, write_s), "write_on_disk_gbps": _gbps(nbytes, write_s + flush_s)}
    if not durable:
        _drop_page_cache(files)
        figures["read_cold_gbps"] = _gbps(nbytes, _timed(read))
        figures["read_hot_gbps"] = _gbps(nbytes, _timed(read))
        _drop_page_cache(files)
        figures["read_into_cold_gbps"] = _gbps(nbytes, _timed(read_into))
        figures["read_into_hot_gbps"] = _gbps(nbytes, _timed(read_into))
        # The same files read plainly (into reused buffers, nothing checked), the same number at a time:
        # what reading files of one block costs on this disk, apart from the store's own work.
        _drop_page_cache(files)
        figures["plain_files_read_cold_gbps"] = _gbps(nbytes, _timed(lambda: _read_plain(files, n_batch, io_threads)))
    if samples:
        sample = keys[:: max(1, num_blocks // samples)][:samples]
        _drop_page_cache(files)
        cold = [_timed(functools.partial(store.read, [k])) for k in sample]
        hot = [_timed(functools.partial(store.read, [k])) for k in sample]
        figures["block_read_cold_us"] = round(statistics.median(cold) * 1e6, 1)
        figures["block_read_hot_us"] = round(statistics.median(hot) * 1e6, 1)
    assert store.stats().checksum_failures == 0
    store.close()
    return figures


def measure_chunks(
    directory: Path, layout: StoreLayout, batch: torch.Tensor, num_blocks: int, chunk_blocks: int, io_threads: int
) -> dict[str, float]:
    """Files of ``chunk_blocks`` blocks each (same format, keyed by the chunk's last block): the alternative."""
    directory.mkdir(parents=True)
    spec = layout.file_spec(chunk_blocks)
    n_batch = batch.shape[3]
    num_chunks = num_blocks // chunk_blocks
    keys = _keys(num_chunks, "chunk")
    paths = [directory / k.hex()[:2] / f"{k.hex()}.kv" for k in keys]
    for p in {p.parent for p in paths}:
        p.mkdir(exist_ok=True)
    nbytes = num_chunks * spec.file_bytes
    chunks_per_batch = n_batch // chunk_blocks
    pool = ThreadPoolExecutor(io_threads)

    def write_one(i: int, chunk: torch.Tensor) -> None:
        tmp = paths[i].with_name(f".{paths[i].name}.tmp")
        write_block_file(paths[i], tmp, keys[i], spec, payload_view(chunk), mtime_ns=time.time_ns(), durable=False)

    def write() -> None:  # a call's worth of chunks at a time, side by side like the store's writes
        for c in range(0, num_chunks, chunks_per_batch):
            per_block = batch.permute(3, 0, 1, 2, 4, 5).contiguous()
            ids = range(c, min(c + chunks_per_batch, num_chunks))
            chunks = [per_block[j * chunk_blocks : (j + 1) * chunk_blocks] for j in range(len(ids))]
            list(pool.map(write_one, ids, chunks))

    def read_one(path: Path, key: bytes) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            read_block_file(fd, os.fstat(fd).st_size, key, spec)
        finally:
            os.close(fd)

    def read() -> None:  # a call's worth of chunks at a time, side by side like the store's reads
        for c in range(0, num_chunks, chunks_per_batch):
            list(pool.map(read_one, paths[c : c + chunks_per_batch], keys[c : c + chunks_per_batch]))

    write_s = _timed(write)
    flush_s = _timed(_flush)
    _drop_page_cache(paths)
    cold_s = _timed(read)
    hot_s = _timed(read)
    pool.shutdown()
    return {
        "write_gbps": _gbps(nbytes, write_s),
        "write_on_disk_gbps": _gbps(nbytes, write_s + flush_s),
        "read_cold_gbps": _gbps(nbytes, cold_s),
        "read_hot_gbps": _gbps(nbytes, hot_s),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    layout = StoreLayout("bench-store", SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, args.block_size, SMOLLM2_HEAD_DIM, dtype)
    block_bytes = layout.file_spec().file_bytes
    n_batch = max(args.chunk_blocks, args.batch_blocks // args.chunk_blocks * args.chunk_blocks)
    num_blocks = max(n_batch, round(args.gb * (1 << 30) / block_bytes) // n_batch * n_batch)
    nbytes = num_blocks * block_bytes
    root = Path(args.path) / f"boundless-bench-store-{os.getpid()}"
    try:
        root.mkdir(parents=True)
    except OSError as e:
        raise SystemExit(f"--path: cannot make a directory in {args.path} ({e.strerror})") from None
    free = shutil.disk_usage(root).free  # (--gb 100000 wrote until the disk was full)
    if 1.2 * nbytes > free:
        root.rmdir()
        need, have = nbytes / _GB, free / _GB
        raise SystemExit(f"--gb {args.gb:g}: {need:.1f} GB to write and room to spare, where {have:.1f} GB are free")
    gen = torch.Generator().manual_seed(0)
    shape = (SMOLLM2_LAYERS, 2, SMOLLM2_KV_HEADS, n_batch, args.block_size, SMOLLM2_HEAD_DIM)
    batch = torch.randn(shape, generator=gen).to(dtype)
    print(f"store benchmark in {root}: {num_blocks} blocks of {block_bytes / 1024:.0f} KiB ({nbytes / _GB:.2f} GB)")
    try:
        results: dict[str, Any] = {
            "path": str(root),
            "layout": {
                "layers": SMOLLM2_LAYERS,
                "kv_heads": SMOLLM2_KV_HEADS,
                "head_dim": SMOLLM2_HEAD_DIM,
                "block_size": args.block_size,
                "dtype": args.dtype,
            },
            "block_file_bytes": block_bytes,
            "blocks": num_blocks,
            "bytes": nbytes,
            "page_cache_dropped": hasattr(os, "posix_fadvise"),
        }
        results["raw"] = measure_raw(root / "raw.bin", nbytes)
        results["checksum"] = measure_checksums()
        threads = args.io_threads
        results["store"] = measure_store(
            root / "store", layout, batch, num_blocks, args.latency_samples, durable=False, io_threads=threads
        )
        results["store_1_thread"] = measure_store(
            root / "store1", layout, batch, num_blocks, 0, durable=False, io_threads=1
        )
        durable_blocks = max(n_batch, min(num_blocks, (256 << 20) // block_bytes // n_batch * n_batch))
        results["store_durable"] = measure_store(
            root / "durable", layout, batch, durable_blocks, 0, durable=True, io_threads=threads
        )
        results["chunks"] = measure_chunks(root / "chunks", layout, batch, num_blocks, args.chunk_blocks, threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw, store = results["raw"], results["store"]
    results["ratios"] = {
        "write_on_disk": round(store["write_on_disk_gbps"] / raw["write_gbps"], 3),
        "read_cold": round(store["read_cold_gbps"] / raw["read_cold_gbps"], 3),
        "read_hot": round(store["read_hot_gbps"] / raw["read_hot_gbps"], 3),
        "read_cold_to_plain_files": round(store["read_cold_gbps"] / store["plain_files_read_cold_gbps"], 3),
        "read_into_cold": round(store["read_into_cold_gbps"] / raw["read_cold_gbps"], 3),
        "read_into_hot": round(store["read_into_hot_gbps"] / raw["read_hot_gbps"], 3),
    }
    _print(results, args.chunk_blocks, args.io_threads)
    if args.json:
        write_json(args.json, results)
    return results


def _print(results: dict[str, Any], chunk_blocks: int, io_threads: int) -> None:
    def row(name: str, f: dict[str, float], suffix: str = "") -> list[Any]:
        reads = ("read_into_cold_gbps", "read_into_hot_gbps") if suffix else ("read_cold_gbps", "read_hot_gbps")
        keys = ("write_gbps", "write_on_disk_gbps", *reads) if not suffix else ("-", "-", *reads)
        return [name, *(f.get(k, "-") for k in keys)]

    raw, store = results["raw"], results["store"]
    rows = [
        ["raw sequential file", "-", raw["write_gbps"], raw["read_cold_gbps"], raw["read_hot_gbps"]],
        row(f"store: 1 block per file, {io_threads} I/O threads", store),
        row("store: read_into a reused buffer", store, "_into"),
        row("store: 1 I/O thread", results["store_1_thread"]),
        ["the store's files read plainly", "-", "-", store["plain_files_read_cold_gbps"], "-"],
        row("store: fsync per file", results["store_durable"]),
        row(f"{chunk_blocks} blocks per file, {io_threads} threads", results["chunks"]),
    ]
    print_table(["GB/s", "write (page cache)", "write (on disk)", "read cold", "read hot"], rows)
    ratios, crc = results["ratios"], results["checksum"]
    print(
        f"one block: {store['block_read_cold_us']} us cold, {store['block_read_hot_us']} us hot; "
        f"crc32 {crc['crc32_gbps']} GB/s, blake2b {crc['blake2b_gbps']} GB/s"
    )
    print(
        f"store / raw: write {ratios['write_on_disk']}, read cold {ratios['read_cold']}, "
        f"read hot {ratios['read_hot']} (goal 0.7); read cold / the same files read plainly "
        f"{ratios['read_cold_to_plain_files']}; read_into (the engine's loads): cold {ratios['read_into_cold']}, "
        f"hot {ratios['read_into_hot']}"
    )
