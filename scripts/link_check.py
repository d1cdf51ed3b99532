"""An emulated link in real time: does it hold its rate, and how long does model traffic wait behind KV?

Four threads push KV transfers through one ``ThrottledLink`` (``time.monotonic``, ``time.sleep``) as
fast as it lets them, while a fifth sends a small model transfer every 10 ms. Prints the KV rate the
link achieved against its nominal rate, and the model transfers' waits against one chunk's time.

    flock /tmp/bench.lock python scripts/link_check.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from boundless.cluster.links import DEFAULT_CHUNK_BYTES, Link, ThrottledLink, Traffic, gbps_to_bytes_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=0.8)
    parser.add_argument("--seconds", type=float, default=4.0, help="about how long the KV threads run")
    args = parser.parse_args()
    rate = gbps_to_bytes_per_s(args.gbps)
    link = ThrottledLink(Link("storage", rate), time.monotonic, time.sleep)
    kv_bytes = 1 << 20
    per_thread = int(args.seconds * rate / kv_bytes / 4)
    waits: list[float] = []
    stop = threading.Event()

    def kv() -> None:
        for _ in range(per_thread):
            link.transfer(kv_bytes, Traffic.KV)

    def model() -> None:
        while not stop.is_set():
            waits.append(link.transfer(64 * 1024, Traffic.MODEL))
            time.sleep(0.01)

    threads = [threading.Thread(target=kv) for _ in range(4)]
    side = threading.Thread(target=model)
    start = time.monotonic()
    for t in [*threads, side]:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    stop.set()
    side.join()
    stats = link.stats()
    carried = stats.bytes_carried["kv"] + stats.bytes_carried["model"]
    chunk_ms = DEFAULT_CHUNK_BYTES / rate * 1e3
    print(
        f"nominal {rate / 1e6:.1f} MB/s; carried {carried / 1e6:.1f} MB in {elapsed:.2f} s wall: "
        f"{carried / elapsed / 1e6:.1f} MB/s ({carried / elapsed / rate:.1%} of nominal)"
    )
    print(f"link busy {stats.busy_s:.2f} s of {elapsed:.2f} s")
    print(
        f"model transfers (64 KiB, {64 * 1024 / rate * 1e3:.2f} ms on the wire): {len(waits)}, waited median "
        f"{statistics.median(waits) * 1e3:.2f} ms, max {max(waits) * 1e3:.2f} ms; one chunk is {chunk_ms:.2f} ms"
    )


if __name__ == "__main__":
    main()
