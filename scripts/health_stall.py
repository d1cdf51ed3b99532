"""How long a server's event loop is held while it takes a request of many samples: the worst ``GET /health``
latency seen, polled every 5 ms, while one ``/v1/completions`` request of ``n`` samples (1, 64, 128) is submitted and
answered. Usage, against a running server that serves ``--served-model-name tiny``::

    python scripts/health_stall.py http://127.0.0.1:8000

Prints, for each ``n``: the status, the request's seconds and the worst ``/health`` milliseconds."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def worst_health_s(client: httpx.AsyncClient, url: str, done: asyncio.Event) -> float:
    worst = 0.0
    while not done.is_set():
        start = time.perf_counter()
        await client.get(url + "/health")
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.005)
    return worst


async def main(url: str) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(3):
            await client.get(url + "/health")
        results = {}
        for n in (1, 64, 128):
            done = asyncio.Event()
            probe = asyncio.create_task(worst_health_s(client, url, done))
            await asyncio.sleep(0.3)
            start = time.perf_counter()
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "n": n}
            reply = await client.post(url + "/v1/completions", json=body)
            took = time.perf_counter() - start
            await asyncio.sleep(0.2)
            done.set()
            worst = await probe
            results[n] = {
                "status": reply.status_code,
                "request_s": round(took, 3),
                "worst_health_ms": round(worst * 1e3, 1),
            }
        print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
