"""``boundless bench frontend``: what the server's front end costs each output token.

On a GPU a small model's decode step takes a few milliseconds, and everything the server does for each token (the
engine loop's hand-off to the event loop, each stream's wake-up, the chunk's JSON, the ASGI layers, the socket write)
runs in the engine's process, under one GIL: the front end can cap the tokens per second and leave the GPU waiting.
This measures it on the same requests (``--num-requests`` random prompts of ``--input-len`` token ids, ``--output-len``
tokens each, ``ignore_eos``, greedy), in turns, each round's prompts new:

- **engine loop**: the server's engine loop alone (:class:`~boundless.engine.async_engine.AsyncEngine`'s thread, its
  requests added with nobody reading their deltas), streamed (text each step) and final-only (text at the end, as a
  response that is not streamed asks); the baseline;
- **async engine**: the same engine, each request's stream read by a coroutine in this process, as the server reads
  them: the thread's hand-off and the event loop, without HTTP;
- **server**: ``boundless serve`` in a subprocess, every request at once from clients in this process, on
  ``/v1/completions`` and ``/v1/chat/completions`` (the prompt's text as a user message), streamed (with
  ``include_usage``) and not.

Each row's output tokens per second, against the engine loop's (streamed, or final-only for an answer that is not
streamed), is what the front end leaves of the engine's speed. On Linux the server's rows also give the CPU time its
event loop's thread (the process's main thread) spent per output token. The clients write raw HTTP/1.1 and read each
response whole before they look at it: the ``openai`` client parses every chunk with pydantic, which on a small
machine costs as much as the server's side of the chunk, on the same cores. Use a tiny model (a directory of
``boundless.model.random_model``; SmolLM2's tokenizer keeps the detokenizing real) so the forward pass costs little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from boundless.bench.offline import make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.restart import MODEL_NAME, ServerProcess
from boundless.config import EngineConfig, engine_config_from_flags, positive_int
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.sampling_params import RequestOutputKind, SamplingParams
from boundless.model.loader import LoadedModel, load_configured_model

ROUTES = ("completions", "chat/completions")


@dataclass(frozen=True)
class Row:
    """One system's run of one round's requests."""

    system: str  # engine loop, async engine, server
    route: str  # the server's route; "-" for the engine's rows
    stream: bool  # text as it is made (a stream), or at the end
    output_tokens: int
    seconds: float
    event_loop_cpu_s: float | None = None  # the server's main thread's CPU time (Linux), None elsewhere

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.system, self.route, self.stream


def _params(output_len: int, stream: bool) -> SamplingParams:
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=kind)


def engine_loop_run(engine: AsyncEngine, prompts: list[list[int]], output_len: int, stream: bool, tag: str) -> Row:
    """The requests through the engine loop with nobody reading them: each finished delta counted in the loop's thread
    (a listener), the run's end when the last one is."""
    done = threading.Event()
    tokens: list[int] = []
    ids = {f"{tag}-{i}" for i in range(len(prompts))}

    def finished(delta: RequestDelta) -> None:
        if delta.request_id in ids:
            tokens.append(delta.num_output_tokens)
            if len(tokens) == len(ids):
                done.set()

    engine.add_finished_listener(finished)
    params = _params(output_len, stream)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(f"{tag}-{i}", prompt, params)
    done.wait()
    seconds = time.perf_counter() - start
    engine.remove_finished_listener(finished)
    return Row("engine loop", "-", stream, sum(tokens), seconds)


def async_engine_run(engine: AsyncEngine, prompts: list[list[int]], output_len: int, tag: str) -> Row:
    """The requests streamed to coroutines, read as the server reads them (their deltas waiting, together)."""
    params = _params(output_len, stream=True)

    async def read_all() -> int:
        streams = [engine.submit(f"{tag}-{i}", prompt, params) for i, prompt in enumerate(prompts)]

        async def read(stream) -> int:
            return sum(len(d.new_token_ids) for batch in [b async for b in stream.batches()] for d in batch)

        return sum(await asyncio.gather(*(read(s) for s in streams)))

    start = time.perf_counter()
    tokens = asyncio.run(read_all())
    return Row("async engine", "-", True, tokens, time.perf_counter() - start)


# -- the server's clients --------------------------------------------------------------------------------------------


def _dechunked(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's content."""
    out: list[bytes] = []
    at = 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2 : end + 2 + size])
        at = end + 2 + size + 2


async def post(port: int, path: str, payload: dict) -> bytes:
    """POST ``payload`` to the server on 127.0.0.1; the response's body, read whole (the connection closes after it)."""
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/%s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {raw[:500]!r}")
    return _dechunked(body) if b"transfer-encoding: chunked" in head.lower() else body


def completion_tokens(body: bytes, stream: bool) -> int:
    """The output tokens a response's usage counts (a stream's in its last chunk, before ``[DONE]``)."""
    if not stream:
        return json.loads(body)["usage"]["completion_tokens"]
    events = body.rstrip(b"\n").split(b"\n\n")
    if events[-1] != b"data: [DONE]":
        raise RuntimeError(f"a stream ended without [DONE]: {body[-300:]!r}")
    return json.loads(events[-2].removeprefix(b"data: "))["usage"]["completion_tokens"]


def request_body(route: str, prompt: list[int], text: str, output_len: int, stream: bool) -> dict:
    body: dict = {"model": MODEL_NAME, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    if route == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def thread_cpu_s(pid: int, tid: int) -> float | None:
    """A thread's CPU time so far (user and system), from Linux's /proc; None where there is none."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_run(
    server: ServerProcess, route: str, prompts: list[list[int]], texts: list[str], output_len: int, stream: bool
) -> Row:
    """Every request at once to ``route``."""
    pid = server.proc.pid
    bodies = [request_body(route, p, t, output_len, stream) for p, t in zip(prompts, texts, strict=True)]

    async def send_all() -> list[bytes]:
        return list(await asyncio.gather(*(post(server.port, route, b) for b in bodies)))

    cpu_before = thread_cpu_s(pid, pid)
    start = time.perf_counter()
    replies = asyncio.run(send_all())
    seconds = time.perf_counter() - start
    cpu_after = thread_cpu_s(pid, pid)
    cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    tokens = sum(completion_tokens(r, stream) for r in replies)
    return Row("server", route, stream, tokens, seconds, cpu)


# -- the run ---------------------------------------------------------------------------------------------------------


def run_rounds(
    engine: AsyncEngine,
    server: ServerProcess,
    loaded: LoadedModel,
    args: argparse.Namespace,
    progress: Callable[[Row], None] = lambda row: None,
) -> list[Row]:
    """Each round: the engine loop (streamed, final-only), the async engine, the server's routes streamed and not, each
    on prompts of its own (no run finds another's prefix in the cache)."""
    runs = [("engine loop", "-", True), ("engine loop", "-", False), ("async engine", "-", True)]
    runs += [("server", route, stream) for route in ROUTES for stream in (True, False)]
    rows: list[Row] = []
    for r in range(args.rounds):
        for k, (system, route, stream) in enumerate(runs):
            prompts = make_prompts(loaded, args.num_requests, args.input_len, args.bench_seed + r * len(runs) + k)
            tag = f"r{r}-{k}"
            if system == "engine loop":
                row = engine_loop_run(engine, prompts, args.output_len, stream, tag)
            elif system == "async engine":
                row = async_engine_run(engine, prompts, args.output_len, tag)
            else:
                texts = [loaded.tokenizer.decode(p) for p in prompts]
                row = server_run(server, route, prompts, texts, args.output_len, stream)
            rows.append(row)
            progress(row)
    return rows


def summarize(rows: list[Row]) -> list[dict]:
    """Medians over the rounds by system, route and stream mode, each against the engine loop's of its mode."""
    keys = list(dict.fromkeys(row.key for row in rows))
    medians = {k: statistics.median(r.tokens_per_s for r in rows if r.key == k) for k in keys}
    out = []
    for system, route, stream in keys:
        mine = [r for r in rows if r.key == (system, route, stream)]
        cpu = [r.event_loop_cpu_s / r.output_tokens for r in mine if r.event_loop_cpu_s is not None]
        out.append(
            {
                "system": system,
                "route": route,
                "stream": stream,
                "output_tokens_per_s": medians[(system, route, stream)],
                "vs_engine_loop": medians[(system, route, stream)] / medians[("engine loop", "-", stream)],
                "event_loop_us_per_token": statistics.median(cpu) * 1e6 if cpu else None,
                "rounds": len(mine),
            }
        )
    return out


def warm_up(engine: AsyncEngine, server: ServerProcess, loaded: LoadedModel, args: argparse.Namespace) -> None:
    """A few tokens through every path first, untimed: the first step's and the first request's one-off costs."""
    prompts = make_prompts(loaded, 2, args.input_len, args.bench_seed - 1)
    engine_loop_run(engine, prompts, 2, True, "warm-loop")
    async_engine_run(engine, prompts, 2, "warm-async")
    for route in ROUTES:
        server_run(server, route, prompts, [loaded.tokenizer.decode(p) for p in prompts], 2, True)


def run(args: argparse.Namespace) -> dict:
    config: EngineConfig = engine_config_from_flags(args)
    loaded = load_configured_model(config.model)
    waiting = max(1024, args.num_requests)  # (every request is sent at once: none may be refused as too many)
    engine = AsyncEngine(EngineCore.from_model(loaded, config), max_waiting=waiting)
    try:
        with tempfile.TemporaryDirectory(prefix="boundless-bench-frontend-") as logs:
            print("the server: boundless serve in a subprocess, the same model and engine flags")
            server = ServerProcess(config, None, Path(logs) / "server.log", extra_flags=["--max-waiting", str(waiting)])
            try:
                warm_up(engine, server, loaded, args)
                rows = run_rounds(engine, server, loaded, args, _print_row)
            finally:
                server.stop()
    finally:
        engine.shutdown()
    summary = summarize(rows)
    print_table(
        ["system", "route", "text", "output tok/s", "vs engine loop", "event loop us/token"],
        [
            [
                s["system"],
                s["route"],
                "streamed" if s["stream"] else "at the end",
                f"{s['output_tokens_per_s']:.0f}",
                f"{s['vs_engine_loop']:.2f}",
                "-" if s["event_loop_us_per_token"] is None else f"{s['event_loop_us_per_token']:.0f}",
            ]
            for s in summary
        ],
    )
    result = {"summary": summary, "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]}
    if args.json:
        write_json(args.json, result | {"args": {k: v for k, v in vars(args).items() if k != "func"}})
    return result


def _print_row(row: Row) -> None:
    text = "streamed" if row.stream else "at the end"
    print(f"  {row.system} {row.route} {text}: {row.output_tokens} tokens in {row.seconds:.2f} s", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=positive_int, default=128, help="requests at once, each run")
    parser.add_argument("--input-len", type=positive_int, default=32)
    parser.add_argument("--output-len", type=positive_int, default=256)
    parser.add_argument("--rounds", type=positive_int, default=2, help="turns of every run; figures are the medians")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
