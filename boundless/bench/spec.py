"""``boundless bench spec``: speculative decoding with n-gram proposals against plain decoding, side by side.

The same conversations, greedy, on two engines over the same loaded weights: one plain, one with
``--speculative-config`` (n-gram proposals, default below), taking turns. Four kinds of agent call: **edit** (a
source file and a small change to make to it: the answer copies most of the file), **extract** (a tool's JSON
result and a request for some of its fields: the answer quotes it), **json** (the same, answered under a JSON
schema, as structured outputs and forced tool calls are: the drafts are checked against the grammar too), and
**free** (an open question: little to copy, so what speculation costs when it rarely hits). Calls run one at a
time by default (an agent waiting for each answer: the regime speculation is for) or ``--concurrency`` at once.
Per kind: output tokens per second of each engine and their ratio, the share of proposed tokens kept, tokens per
forward pass of the speculating engine, and whether the outputs are the same (greedy: they must be).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from boundless.bench.report import print_table, write_json
from boundless.config import engine_config_from_flags
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import StructuredOutput
from boundless.llm import LLM
from boundless.model.loader import load_model

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

_FILES = [
    (
        "def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
        "    return total\n\n\ndef average_price(items):\n    if not items:\n        return 0\n"
        "    return total_price(items) / len(items)\n",
        "Rename the function total_price to order_total everywhere.",
    ),
    (
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
        "        self.count += 1\n\n    def reset(self):\n        self.count = 0\n",
        "Add a method decrement that subtracts one from count.",
    ),
    (
        "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
        "def save_config(path, config):\n    with open(path, 'w') as f:\n        json.dump(config, f)\n",
        "Make save_config write the JSON with indent=2.",
    ),
    (
        "def is_even(n):\n    return n % 2 == 0\n\n\ndef is_odd(n):\n    return n % 2 == 1\n\n\n"
        "def evens(numbers):\n    return [n for n in numbers if is_even(n)]\n",
        "Add a function odds that returns the odd numbers, like evens.",
    ),
]
_RECORDS = [
    {"name": "Ada Lovelace", "city": "London", "email": "ada@example.com", "role": "engineer"},
    {"name": "Alan Turing", "city": "Manchester", "email": "alan@example.com", "role": "researcher"},
    {"name": "Grace Hopper", "city": "New York", "email": "grace@example.com", "role": "admiral"},
    {"name": "Edsger Dijkstra", "city": "Eindhoven", "email": "edsger@example.com", "role": "professor"},
]
_QUESTIONS = [
    "Why is the sky blue?",
    "What makes a good cup of tea?",
    "How do bees make honey?",
    "Why do we have seasons?",
]


def conversations(kind: str, num: int) -> list[list[dict[str, str]]]:
    """``num`` conversations of one kind of call (edit, extract or free)."""
    convs = []
    for i in range(num):
        if kind == "edit":
            source, change = _FILES[i % len(_FILES)]
            content = f"Here is a file:\n\n```python\n{source}```\n\n{change} Reply with the whole new file."
        elif kind in ("extract", "json"):
            records = _RECORDS[i % len(_RECORDS) :] + _RECORDS[: i % len(_RECORDS)]
            content = (
                f"The tool search_people returned:\n{json.dumps(records, indent=1)}\n\n"
                "List each person's name and email, one per line, as they appear."
            )
        elif kind == "free":
            content = _QUESTIONS[i % len(_QUESTIONS)]
        else:
            raise ValueError(f"unknown kind {kind!r}")
        convs.append([{"role": "user", "content": content}])
    return convs


KINDS = ("edit", "extract", "json", "free")
# The json kind's answer: each person's name and email.
PEOPLE_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name", "email"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


@dataclass
class SpecFigures:
    kind: str
    output_tokens: int
    plain_s: float
    spec_s: float
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float  # spec / plain tokens per second
    acceptance: float  # proposed tokens kept, over those proposed
    tokens_per_pass: float  # output tokens per forward pass that produced some, speculating engine
    same_outputs: int  # conversations whose outputs are identical (greedy: all of them)
    conversations: int


def _run(llm: LLM, convs: list, params: SamplingParams, concurrency: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(convs), concurrency):
        tokens += [o.outputs[0].token_ids for o in llm.chat(convs[i : i + concurrency], params)]
    return tokens, time.perf_counter() - start


def measure(plain: LLM, spec: LLM, kind: str, num: int, max_tokens: int, rounds: int, concurrency: int) -> SpecFigures:
    """Both engines over the same conversations, taking turns; medians of ``rounds`` each."""
    convs = conversations(kind, num)
    structured = StructuredOutput.json_schema(PEOPLE_SCHEMA) if kind == "json" else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=structured)
    plain_s, spec_s = [], []
    plain_out: list[list[int]] = []
    spec_out: list[list[int]] = []
    engine = spec.engine
    draft0, accepted0 = engine.counters.draft_tokens, engine.counters.accepted_tokens
    for turn in range(rounds):
        for which in ("plain", "spec") if turn % 2 == 0 else ("spec", "plain"):
            if which == "plain":
                plain_out, seconds = _run(plain, convs, params, concurrency)
                plain_s.append(seconds)
            else:
                spec_out, seconds = _run(spec, convs, params, concurrency)
                spec_s.append(seconds)
    drafts = engine.counters.draft_tokens - draft0
    accepted = engine.counters.accepted_tokens - accepted0
    tokens = sum(len(t) for t in spec_out)
    p, s = statistics.median(plain_s), statistics.median(spec_s)
    plain_tokens = sum(len(t) for t in plain_out)
    return SpecFigures(
        kind=kind,
        output_tokens=tokens,
        plain_s=p,
        spec_s=s,
        plain_tokens_per_s=plain_tokens / p,
        spec_tokens_per_s=tokens / s,
        speedup=(tokens / s) / (plain_tokens / p),
        acceptance=accepted / drafts if drafts else 0.0,
        # Each pass that produced tokens gave one, plus the drafts it kept (over every round).
        tokens_per_pass=(tokens * rounds) / (tokens * rounds - accepted) if tokens else 0.0,
        same_outputs=sum(a == b for a, b in zip(plain_out, spec_out, strict=True)),
        conversations=num,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config_from_flags(args)
    if config.scheduler.speculative_config is not None:
        raise SystemExit("bench spec sets --speculative-config on its second engine itself: use --spec instead")
    if args.rounds < 1 or args.concurrency < 1:
        raise SystemExit("--rounds and --concurrency must be at least 1")
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"--kinds: unknown kind {kind!r}; of {', '.join(KINDS)}")
    loaded = load_model(config.model.model, dtype=config.model.dtype, device=config.model.device)
    spec_config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, speculative_config=args.spec)
    )
    plain, spec = LLM.from_config(config, loaded), LLM.from_config(spec_config, loaded)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (plain, spec):  # the first steps' allocations and kernels' first calls, the json kind's grammar
        llm.chat(conversations("free", 2), warm)
        if "json" in kinds:
            llm.chat(
                conversations("json", 1),
                dataclasses.replace(warm, structured=StructuredOutput.json_schema(PEOPLE_SCHEMA)),
            )
    figures = [
        measure(plain, spec, kind, args.num_conversations, args.max_tokens, args.rounds, args.concurrency)
        for kind in kinds
    ]
    plain.close()
    spec.close()
    print(
        f"{args.num_conversations} conversations per kind, greedy, {args.max_tokens} tokens at most, "
        f"{args.concurrency} at a time; medians of {args.rounds} runs each, taking turns; spec: {args.spec}"
    )
    print_table(
        ["kind", "plain tok/s", "spec tok/s", "spec / plain", "drafts kept", "tokens per pass", "same outputs"],
        [
            [
                f.kind,
                f"{f.plain_tokens_per_s:.1f}",
                f"{f.spec_tokens_per_s:.1f}",
                f"{f.speedup:.2f}x",
                f"{f.acceptance:.0%}",
                f"{f.tokens_per_pass:.2f}",
                f"{f.same_outputs}/{f.conversations}",
            ]
            for f in figures
        ],
    )
    result = {
        "model": config.model.model,
        "spec": json.loads(args.spec),
        "num_conversations": args.num_conversations,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "figures": [asdict(f) for f in figures],
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", default=json.dumps(DEFAULT_SPEC), help="the speculating engine's --speculative-config"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kinds of call, comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--num-conversations", type=int, default=4, help="conversations per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed runs per engine, taking turns; figures are medians"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="conversations run at once (1: one after another)")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this file")
