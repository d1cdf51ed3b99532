"""``boundless bench structured``: structured outputs against free decoding, side by side.

Two figures. **Served pause**: a free completion streams from a fresh server while the server's first structured
request comes in (xgrammar's import, the vocabulary's reading and the grammar's compilation all happen then, off the
engine's steps); the free stream's longest pause against its median gap between chunks says what that request cost
everyone else. **Throughput**: the same conversations, greedy, free and under a JSON schema (compiled in a warm-up),
taking turns; tokens per second of each and their ratio (the grammar's per-step mask and matcher cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from boundless.bench.report import output_path, print_table, write_json
from boundless.config import engine_config_from_flags, positive_int
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import StructuredOutput
from boundless.llm import LLM
from boundless.model.loader import load_configured_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TOPICS = ("a teacher", "a sailor", "a painter", "a farmer", "a doctor", "a pilot", "a baker", "a poet")


@dataclass
class ThroughputFigures:
    mode: str  # free, or json_schema
    output_tokens: int
    seconds: float
    output_tokens_per_s: float


@dataclass
class PauseFigures:
    free_chunks: int
    median_gap_s: float
    longest_gap_s: float  # the free stream's longest wait for a chunk while the structured request came in
    structured_s: float  # the structured request's own time, first compile included
    structured_valid: bool


def conversations(num: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}] for i in range(num)]


def measure_throughput(llm: LLM, num: int, max_tokens: int, rounds: int) -> list[ThroughputFigures]:
    """Free and structured runs of the same conversations, taking turns; the medians of ``rounds`` each."""
    convs = conversations(num)
    modes = {
        "free": SamplingParams(temperature=0.0, max_tokens=max_tokens),
        "json_schema": SamplingParams(
            temperature=0.0, max_tokens=max_tokens, structured=StructuredOutput.json_schema(SCHEMA)
        ),
    }
    for params in modes.values():  # warm-up: the grammar compiles here, and the first steps' allocations
        llm.chat(convs[:2], dataclasses.replace(params, max_tokens=4))
    runs: dict[str, list[tuple[int, float]]] = {mode: [] for mode in modes}
    for turn in range(rounds):
        order = list(modes) if turn % 2 == 0 else list(reversed(modes))
        for mode in order:
            start = time.perf_counter()
            outs = llm.chat(convs, modes[mode])
            seconds = time.perf_counter() - start
            runs[mode].append((sum(len(o.outputs[0].token_ids) for o in outs), seconds))
    figures = []
    for mode, measured in runs.items():
        tokens = statistics.median(t for t, _ in measured)
        seconds = statistics.median(s for _, s in measured)
        figures.append(ThroughputFigures(mode, int(tokens), seconds, tokens / seconds))
    return figures


def measure_pause(llm: LLM, model: str, stream_tokens: int) -> PauseFigures:
    """A free stream from a fresh server; after its 10th chunk, the server's first structured request."""
    import openai

    from boundless.api.launch import start_in_thread
    from boundless.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine)
    server = start_in_thread(engine, model)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer: dict[str, Any] = {}

    def structured() -> None:
        question = conversations(1)[0][0]["content"]  # (as the client's typed message below)
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=64,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        answer["seconds"] = time.perf_counter() - start
        answer["text"] = reply.choices[0].message.content or ""

    try:
        times = []
        thread = None
        chunks = client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=stream_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(chunks):
            times.append(time.perf_counter())
            if i == 10:
                thread = threading.Thread(target=structured)
                thread.start()
        assert thread is not None, "the free stream ended before the structured request was sent"
        thread.join()
    finally:
        server.stop()
        engine.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    try:
        valid = isinstance(json.loads(answer.get("text", "")), dict)
    except ValueError:
        valid = False
    return PauseFigures(len(times), statistics.median(gaps), max(gaps[10:]), answer["seconds"], valid)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config_from_flags(args)
    loaded = load_configured_model(config.model)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    # The pause first, on a fresh engine in a process that has not used xgrammar yet: the first structured request.
    pause = measure_pause(LLM.from_config(config, loaded), config.model.model, args.stream_tokens)
    print("a free stream while the server's first structured request comes in:")
    print_table(
        ["free chunks", "median gap (s)", "longest gap (s)", "structured request (s)", "valid JSON"],
        [
            [
                pause.free_chunks,
                f"{pause.median_gap_s:.4f}",
                f"{pause.longest_gap_s:.3f}",
                f"{pause.structured_s:.2f}",
                pause.structured_valid,
            ]
        ],
    )
    figures = measure_throughput(LLM.from_config(config, loaded), args.num_conversations, args.max_tokens, args.rounds)
    free, constrained = figures
    ratio = constrained.output_tokens_per_s / free.output_tokens_per_s
    print(f"\n{args.num_conversations} conversations, greedy, medians of {args.rounds} runs each, taking turns:")
    print_table(
        ["mode", "output tok/s", "seconds", "output tokens"],
        [[f.mode, f"{f.output_tokens_per_s:.1f}", f"{f.seconds:.2f}", f.output_tokens] for f in figures],
    )
    print(f"json_schema / free throughput: {ratio:.2f}x")
    result = {
        "model": config.model.model,
        "num_conversations": args.num_conversations,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "pause": asdict(pause),
        "figures": [asdict(f) for f in figures],
        "throughput_ratio": ratio,
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-conversations", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per mode, taking turns; figures are medians")
    parser.add_argument(
        "--stream-tokens", type=positive_int, default=150, help="tokens of the free stream the pause is read on"
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
