"""``boundless bench serve``: an online load generator against a running server.

Requests arrive by a Poisson process (``--rate``) or replay a trace's arrivals and lengths
(``--trace``). Prompts are random token ids of the scheduled length (sent as token ids, so their
length is exact), each streamed through the async ``openai`` client. One small request goes first, as vLLM's
benchmark sends: a server that cannot be reached, or refuses the flags, stops the run with the flag's one line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.traces import TraceRequest, load_trace, poisson_schedule
from boundless.config import non_negative_float, positive_int

if TYPE_CHECKING:
    import openai


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _one(client, model: str, req: TraceRequest, vocab: int, rng: random.Random) -> RequestResult:
    prompt = [rng.randrange(100, vocab) for _ in range(req.input_len)]
    start = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=req.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # a failed request is counted, not fatal
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    return RequestResult(True, ttft if ttft is not None else e2e, e2e, tokens)


def api_root(base_url: str) -> str:
    """The OpenAI API root of a server given as ``http://host:port`` or ``http://host:port/v1``."""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


async def check_server(client: openai.AsyncOpenAI, model: str) -> None:
    """One small request before the load, as vLLM's benchmark sends: a server that cannot be reached, or that
    refuses the flags, is the flag's one line (SystemExit), not a table of NaN after every request has failed."""
    import openai

    try:
        await client.completions.create(model=model, prompt=[100] * 4, max_tokens=1, temperature=0.0)
    except openai.APIConnectionError as e:  # (a timeout too)
        raise SystemExit(f"--base-url: cannot reach the server at {client.base_url} ({e})") from None
    except openai.AuthenticationError as e:
        raise SystemExit(f"--api-key: the server refused it ({e})") from None
    except openai.NotFoundError as e:
        raise SystemExit(f"--model: the server at {client.base_url} does not serve {model!r} ({e})") from None
    except openai.APIStatusError as e:
        raise SystemExit(f"--base-url: the server at {client.base_url} refused a test request ({e})") from None


async def run_load(base_url: str, model: str, schedule: list[TraceRequest], vocab: int, api_key: str) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=api_root(base_url), api_key=api_key, max_retries=0, timeout=3600)
    await check_server(client, model)
    rng = random.Random(0)
    bar = tqdm(total=len(schedule), desc="requests", unit="req")
    start = time.perf_counter()

    async def fire(req: TraceRequest) -> RequestResult:
        delay = req.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        result = await _one(client, model, req, vocab, rng)
        bar.update(1)
        return result

    results = await asyncio.gather(*(fire(r) for r in schedule))
    wall = time.perf_counter() - start
    bar.close()
    await client.close()
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "mean_input_len": statistics.fmean(r.input_len for r in schedule),
        "mean_output_len": statistics.fmean(r.output_len for r in schedule),
    }
    for name, values in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e)):
        for q in (0.5, 0.95, 0.99):
            summary[f"{name}_p{int(q * 100)}"] = percentile(values, q)
        summary[f"{name}_mean"] = statistics.fmean(values) if values else float("nan")
    return summary


def run(args: argparse.Namespace) -> dict:
    if args.vocab_size <= 100:  # (random prompts take ids from 100 up, past the special tokens)
        raise SystemExit(f"--vocab-size: more than 100, not {args.vocab_size}")
    if args.trace:
        schedule = trace_schedule(args)
    else:
        schedule = poisson_schedule(args.num_requests, args.rate, args.input_len, args.output_len, seed=args.bench_seed)
    summary = asyncio.run(run_load(args.base_url, args.model, schedule, args.vocab_size, args.api_key))
    summary.update({"base_url": args.base_url, "rate": None if args.trace else args.rate, "trace": args.trace})
    if not summary["completed"]:  # (the server died or refused them after the test request): no figures to print
        raise SystemExit(f"bench serve: all {summary['requests']} requests failed: {'; '.join(summary['errors'])}")
    rows = [
        [
            metric,
            f"{summary[metric + '_p50']:.3f}",
            f"{summary[metric + '_p95']:.3f}",
            f"{summary[metric + '_p99']:.3f}",
        ]
        for metric in ("ttft_s", "tpot_s", "e2e_s")
    ]
    print_table(["latency", "p50", "p95", "p99"], rows)
    print(
        f"{summary['completed']}/{summary['requests']} requests in {summary['duration_s']:.1f} s: "
        f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s"
    )
    if summary["failed"]:
        print(f"{summary['failed']} requests failed: {'; '.join(summary['errors'])}", file=sys.stderr)
    if args.json:
        write_json(args.json, summary | {"args": {k: v for k, v in vars(args).items() if k != "func"}})
    return summary


def trace_schedule(args: argparse.Namespace) -> list[TraceRequest]:
    """``--trace``'s requests; a file that is not there, or holds no requests, is the flag's one line."""
    try:
        return load_trace(
            args.trace,
            max_requests=args.num_requests,
            time_scale=args.time_scale,
            length_scale=args.length_scale,
            max_input_len=args.max_input_len,
            max_output_len=args.max_output_len,
        )
    except OSError as e:
        raise SystemExit(f"--trace: {e.strerror or e}: {args.trace!r}") from None
    except ValueError as e:
        raise SystemExit(f"--trace: {e}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    parser.add_argument("--model", default="smollm2-135m", help="the model name the server serves")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument(
        "--rate", type=non_negative_float, default=2.0, help="Poisson arrivals per second (without --trace)"
    )
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--trace", help="replay a trace: Azure .csv or Mooncake .jsonl from ../shared/traces")
    parser.add_argument("--time-scale", type=non_negative_float, default=1.0, help="multiply trace arrival times")
    parser.add_argument("--length-scale", type=non_negative_float, default=1.0, help="multiply trace lengths")
    parser.add_argument("--max-input-len", type=positive_int, default=1024)
    parser.add_argument("--max-output-len", type=positive_int, default=256)
    parser.add_argument("--vocab-size", type=int, default=49152, help="token ids of random prompts stay below this")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
