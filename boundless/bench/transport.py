"""``boundless bench transport``: each transport's latency and bandwidth between two processes, against a
plain memory copy of the same bytes in the same run.

For every implementation that can run here (gloo and shared memory always; NIXL and Mooncake when their
packages are installed) a second process is started and, for each message size,

- latency: ping-pong of one message (rank 0 sends, rank 1 sends it back), median round trip / 2;
- bandwidth: rank 0 sends ``n`` messages back to back (up to ``--window`` in flight), rank 1 receives them
  and answers one byte; bytes / time from the first send to the answer.

Buffers are allocated once per size and registered with the transport (as a KV cache would be). The copy
is ``dst.copy_(src)`` of the same bytes in this process (median time), measured again right after each
transport's figures at each size, so that a ratio compares two measurements under the same load (the
first table rows are the copy measured alone, before the transports). Ratios are transport / copy (GB/s)
and copy / transport (latency); the chosen default is the fastest transport by the geometric mean of its
GB/s at messages of 1 MB and more, among those that reach another node, and among all on one node
(:func:`choose_default`). GB are 10^9 bytes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from boundless.bench.report import output_path, print_table, write_json
from boundless.config import positive_float, positive_int
from boundless.transport.endpoints import (
    KINDS,
    EndpointSpec,
    TransportUnavailable,
    exchange_addresses,
    open_endpoint,
)

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
CROSS_NODE = ("gloo", "nixl", "mooncake")  # shared memory stays on one node
_GB = 1e9
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    unit = _UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", default=",".join(KINDS), help="transports to measure (those unavailable skip)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes (bytes; K, M, G suffixes)")
    parser.add_argument("--mb-per-size", type=float, default=256.0, help="MB sent per size for the bandwidth")
    parser.add_argument("--latency-iters", type=int, default=200, help="round trips timed per size (at most)")
    parser.add_argument("--window", type=positive_int, default=4, help="messages in flight for the bandwidth")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every transport, in turns; medians")
    parser.add_argument("--timeout-s", type=positive_float, default=60.0, help="per-transfer timeout")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")


def _plan(size: int, mb_per_size: float, latency_iters: int) -> tuple[int, int]:
    """(round trips, bandwidth messages) for one size: fewer for large messages, at least a few."""
    n_bw = max(4, min(1000, int(mb_per_size * 1e6 / size)))
    n_lat = max(5, min(latency_iters, int(64e6 / size)))
    return n_lat, n_bw


def _buffers(size: int, count: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(count)]


def _peer(spec: EndpointSpec, sizes: list[int], mb_per_size: float, latency_iters: int, window: int) -> None:
    """Rank 1: echoes the round trips and takes the streams (the mirror of :func:`_measure`)."""
    try:
        t = open_endpoint(spec)
    except TransportUnavailable:
        return
    peer = exchange_addresses(spec, t)[0]
    ack = torch.ones(1, dtype=torch.uint8)
    t.register(ack)
    for size in sizes:
        n_lat, n_bw = _plan(size, mb_per_size, latency_iters)
        bufs = _buffers(size, window)
        for b in bufs:
            t.register(b)
        for _ in range(n_lat + 1):  # one warm-up
            t.recv(peer, 1, bufs[0]).wait()
            t.send(peer, 2, bufs[0]).wait()
        for _ in range(2):  # a warm-up stream, then the timed one
            pending = [t.recv(peer, 3, bufs[i % window]) for i in range(min(window, n_bw))]
            for i in range(n_bw):
                pending[i % len(pending)].wait()
                if i + window < n_bw:
                    pending[i % len(pending)] = t.recv(peer, 3, bufs[(i + window) % window])
            t.send(peer, 4, ack).wait()
        for b in bufs:
            t.unregister(b)
    t.close()
    os._exit(0)  # skip the libraries' exit handlers (see transport/nixl.py)


def _measure(t: Any, peer: str, size: int, mb_per_size: float, latency_iters: int, window: int) -> dict[str, float]:
    n_lat, n_bw = _plan(size, mb_per_size, latency_iters)
    bufs = _buffers(size, window)
    back = torch.empty(size, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    for b in [*bufs, back, ack]:
        t.register(b)
    rtts = []
    for i in range(n_lat + 1):
        start = time.perf_counter()
        receiving = t.recv(peer, 2, back)
        t.send(peer, 1, bufs[0]).wait()
        receiving.wait()
        if i:
            rtts.append(time.perf_counter() - start)
    assert torch.equal(back, bufs[0]), "the echo came back changed"
    stream_s = 0.0
    for _ in range(2):
        start = time.perf_counter()
        acking = t.recv(peer, 4, ack)
        sending = [t.send(peer, 3, bufs[i % window]) for i in range(min(window, n_bw))]
        for i in range(n_bw):
            sending[i % len(sending)].wait()
            if i + window < n_bw:
                sending[i % len(sending)] = t.send(peer, 3, bufs[(i + window) % window])
        acking.wait()
        stream_s = time.perf_counter() - start
    for b in [*bufs, back, ack]:
        t.unregister(b)
    copy = measure_copy(size, _copy_iters(size), window)
    gbps, latency_us = n_bw * size / stream_s / _GB, statistics.median(rtts) / 2 * 1e6
    return {
        "latency_us": round(latency_us, 1),
        "gbps": round(gbps, 3),
        "copy_latency_us": copy["latency_us"],
        "copy_gbps": copy["gbps"],
        "gbps_ratio": round(gbps / copy["gbps"], 3),
        "latency_ratio": round(copy["latency_us"] / latency_us, 4),
        "round_trips": n_lat,
        "messages": n_bw,
    }


def _copy_iters(size: int) -> int:
    return max(20, min(1000, int(1e9 / size)))


def measure_copy(size: int, iters: int, window: int) -> dict[str, float]:
    """``dst.copy_(src)`` of ``size`` bytes: median time, as latency and GB/s. The copies rotate over
    ``window`` pairs of buffers, as the transports' messages do, so that neither side stays in a cache the
    transports do not get."""
    srcs = _buffers(size, window)
    dsts = [torch.empty(size, dtype=torch.uint8) for _ in range(window)]
    for s, d in zip(srcs, dsts, strict=True):
        d.copy_(s)
    times = []
    for i in range(iters):
        src, dst = srcs[i % window], dsts[i % window]
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"latency_us": round(median * 1e6, 2), "gbps": round(size / median / _GB, 3)}


def measure_kind(kind: str, sizes: list[int], args: argparse.Namespace) -> dict[int, dict[str, float]] | str:
    """The figures of one transport by size, or why it could not run."""
    directory = tempfile.mkdtemp(prefix=f"boundless-bench-{kind}-", dir="/dev/shm" if kind == "shm" else None)
    spec = EndpointSpec(kind, directory, rank=0, world_size=2, timeout_s=args.timeout_s)
    peer_spec = EndpointSpec(kind, directory, rank=1, world_size=2, timeout_s=args.timeout_s)
    proc = mp.get_context("spawn").Process(
        target=_peer, args=(peer_spec, sizes, args.mb_per_size, args.latency_iters, args.window)
    )
    proc.start()
    try:
        try:
            t = open_endpoint(spec)
        except TransportUnavailable as e:
            return str(e)
        peer = exchange_addresses(spec, t)[1]
        out = {size: _measure(t, peer, size, args.mb_per_size, args.latency_iters, args.window) for size in sizes}
        t.close()
        return out
    finally:
        proc.join(timeout=args.timeout_s)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _medians(by_run: list[dict[int, dict[str, float]]], sizes: list[int]) -> dict[int, dict[str, float]]:
    """Each figure's median over the runs."""
    return {
        size: {key: statistics.median(run[size][key] for run in by_run) for key in by_run[0][size]} for size in sizes
    }


def choose_default(results: dict[str, dict[int, dict[str, float]]], kinds: tuple[str, ...]) -> str | None:
    """The transport among ``kinds`` with the highest geometric mean of its GB/s at messages of 1 MB and
    more (the KV moves; small messages are few per step and latency-bound). GB/s, not the ratios to the
    copy: the transports are measured in turns under the same load, while each ratio also carries the
    noise of its own copy measurement."""

    def score(kind: str) -> float:
        rates = [f["gbps"] for size, f in results[kind].items() if size >= (1 << 20)]
        return math.exp(sum(math.log(max(r, 1e-9)) for r in rates) / len(rates)) if rates else 0.0

    candidates = [k for k in kinds if k in results]
    return max(candidates, key=score) if candidates else None


def _available(kind: str) -> str | None:
    """Why a transport's package cannot load here (checked before spawning a peer for it)."""
    if kind not in KINDS:
        return f"unknown transport (one of {', '.join(KINDS)})"
    module = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}.get(kind)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:
        return f"{module}: {e}"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as e:
        raise SystemExit(f"--sizes: {e}") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--sizes: every size must be at least a byte, not {args.sizes!r}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not any(k in KINDS for k in kinds):  # (an unknown one beside known ones is skipped, and said so)
        raise SystemExit(f"--kinds: no transport named ({args.kinds!r}); choose from {', '.join(KINDS)}")
    copy = {size: measure_copy(size, _copy_iters(size), args.window) for size in sizes}
    runs: dict[str, list[dict[int, dict[str, float]]]] = {}
    skipped: dict[str, str] = {}
    for r in range(args.repeats):  # the transports take turns, so that a change of load hits them all
        for kind in kinds:
            if kind in skipped:
                continue
            measured = _available(kind) or measure_kind(kind, sizes, args)
            if isinstance(measured, str):
                skipped[kind] = measured
                print(f"{kind}: skipped ({measured})")
                continue
            runs.setdefault(kind, []).append(measured)
            print(f"{kind}: measured (run {r + 1} of {args.repeats})")
    results = {kind: _medians(by_run, sizes) for kind, by_run in runs.items()}
    chosen = {
        "one_node": choose_default(results, tuple(results)),
        "across_nodes": choose_default(results, CROSS_NODE),
    }
    _print(sizes, copy, results, chosen)
    out = {
        "sizes": sizes,
        "copy": {str(s): f for s, f in copy.items()},
        "transports": {k: {str(s): f for s, f in v.items()} for k, v in results.items()},
        "skipped": skipped,
        "default": chosen,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    if args.json:
        write_json(args.json, out)
    return out


def _size_name(size: int) -> str:
    for unit, n in (("M", 1 << 20), ("K", 1 << 10)):
        if size >= n and size % n == 0:
            return f"{size // n}{unit}"
    return str(size)


def _print(sizes: list[int], copy: dict, results: dict, chosen: dict[str, str | None]) -> None:
    rows = [["memory copy", _size_name(s), copy[s]["latency_us"], copy[s]["gbps"], "", "", ""] for s in sizes]
    for kind, by_size in results.items():
        for s in sizes:
            f = by_size[s]
            rows.append(
                [kind, _size_name(s), f["latency_us"], f["gbps"], f["copy_gbps"], f["gbps_ratio"], f["latency_ratio"]]
            )
    header = ["transport", "message", "latency us", "GB/s", "copy GB/s", "GB/s / copy", "copy / latency"]
    print_table(header, rows)
    print(f"default on one node: {chosen['one_node']}; across nodes: {chosen['across_nodes']}")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
