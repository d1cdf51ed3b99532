"""``boundless bench spec``: speculative decoding against plain decoding, side by side.

The same conversations, greedy, on two engines over the same loaded weights: one plain, one with
``--speculative-config`` (``--spec``: n-gram proposals by default, or suffix decoding), taking turns, each run on
fresh engines (no prefix cache, and no cached outputs for suffix decoding, left from an earlier run). Five kinds of
agent call: **edit** (a source file and a small change to make to it: the answer copies most of the file),
**extract** (a tool's JSON result and a request for some of its fields: the answer quotes it), **json** (the same,
answered under a JSON schema, as structured outputs are: the drafts are checked against the grammar too), **calls**
(requests an agent turns into tool calls, under the forced-call grammar of ``tool_choice: required``: each answer
is a call like the ones before it, which the prompt does not spell out), and **free** (an open question: little to
copy, so what speculation costs when it rarely hits). Calls run one at a time by default (an agent waiting for each
answer: the regime speculation is for) or ``--concurrency`` at once. Per kind: output tokens per second of each
engine and their ratio, the share of proposed tokens kept, tokens per forward pass of the speculating engine, and
whether the outputs are the same (greedy: they must be).

``--spec prediction`` measures OpenAI's Predicted Outputs instead: the second engine has no proposer, and each edit
call brings the file it edits as its ``prediction`` (the answer is the file with the change made), as an agent that
rewrites a file sends it; the other kinds have nothing to predict, so their calls bring none (the engines then do the
same work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from boundless.api.tool_calls import forced_call_schema
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import engine_config_from_flags, positive_int
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import StructuredOutput
from boundless.llm import LLM
from boundless.model.loader import load_configured_model

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# --spec's value for Predicted Outputs: drafts from each call's prediction, not from a proposer.
PREDICTION = "prediction"

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
# The calls kind: an agent's tools, and requests it turns into calls of them.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city on a date",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"}},
                "required": ["city", "date"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a table at a restaurant",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string"},
                    "people": {"type": "integer"},
                    "time": {"type": "string", "description": "HH:MM"},
                },
                "required": ["restaurant", "people", "time"],
            },
        },
    },
]
_CITIES = ["Paris", "Oslo", "Lisbon", "Kyoto", "Lima", "Cairo", "Denver", "Perth"]
_RESTAURANTS = ["Chez Anna", "Luigi's", "The Blue Door", "Sakura", "El Faro", "Nordic Table", "Casa Verde", "Mama's"]
_QUESTIONS = [
    "Why is the sky blue?",
    "What makes a good cup of tea?",
    "How do bees make honey?",
    "Why do we have seasons?",
]


def predictions(kind: str, num: int) -> list[str | None]:
    """What each of :func:`conversations`' calls would bring as its ``prediction``: an edit's file, as the answer
    writes it (a fenced block); None for the other kinds."""
    if kind != "edit":
        return [None] * num
    return [f"```python\n{_FILES[i % len(_FILES)][0]}```" for i in range(num)]


def conversations(kind: str, num: int) -> list[list[dict[str, str]]]:
    """``num`` conversations of one kind of call (:data:`KINDS`)."""
    convs = []
    for i in range(num):
        if kind == "calls":
            if i % 2 == 0:
                ask = f"What will the weather be in {_CITIES[i // 2 % 8]} on 2026-12-{4 + i % 20:02d}?"
            else:
                ask = f"Book a table for {2 + i % 5} at {_RESTAURANTS[i // 2 % 8]} at {18 + i % 4}:{15 * (i % 4):02d}."
            system = f"You are an agent. Answer each request with tool calls. Tools: {json.dumps(TOOLS)}"
            convs.append([{"role": "system", "content": system}, {"role": "user", "content": ask}])
            continue
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


KINDS = ("edit", "extract", "json", "calls", "free")
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


def _run(llm: LLM, convs: list, params: list[SamplingParams], concurrency: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(convs), concurrency):
        tokens += [o.outputs[0].token_ids for o in llm.chat(convs[i : i + concurrency], params[i : i + concurrency])]
    return tokens, time.perf_counter() - start


def structured_output(kind: str) -> StructuredOutput | None:
    """The grammar a kind's answers are held to: the json kind's schema, the calls kind's forced calls."""
    if kind == "json":
        return StructuredOutput.json_schema(PEOPLE_SCHEMA)
    if kind == "calls":
        return StructuredOutput.json_schema(forced_call_schema(TOOLS, None), "tools")
    return None


def measure(
    fresh: Callable[[bool, StructuredOutput | None], LLM],
    kind: str,
    num: int,
    max_tokens: int,
    rounds: int,
    concurrency: int,
    predicted: bool = False,
) -> SpecFigures:
    """Both engines over the same conversations, taking turns, each run on a fresh engine (``fresh(speculating,
    grammar)``, warmed up with the kind's grammar); medians of ``rounds`` each. ``predicted``: the speculating
    engine's calls bring their :func:`predictions` (Predicted Outputs)."""
    convs = conversations(kind, num)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=structured_output(kind))
    plain_params = [params] * num
    plain_s, spec_s = [], []
    plain_out: list[list[int]] = []
    spec_out: list[list[int]] = []
    drafts = accepted = 0
    for turn in range(rounds):
        for speculating in (False, True) if turn % 2 == 0 else (True, False):
            llm = fresh(speculating, params.structured)
            if not speculating:
                plain_out, seconds = _run(llm, convs, plain_params, concurrency)
                plain_s.append(seconds)
            else:
                counters = llm.engine.counters
                draft0, accepted0 = counters.draft_tokens, counters.accepted_tokens  # (the warm-up's)
                spec_params = plain_params
                if predicted:
                    spec_params = [
                        params
                        if text is None
                        else dataclasses.replace(
                            params, prediction=tuple(llm.tokenizer.encode(text, add_special_tokens=False))
                        )
                        for text in predictions(kind, num)
                    ]
                spec_out, seconds = _run(llm, convs, spec_params, concurrency)
                spec_s.append(seconds)
                drafts += counters.draft_tokens - draft0
                accepted += counters.accepted_tokens - accepted0
            llm.close()
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
    loaded = load_configured_model(config.model)
    predicted = args.spec == PREDICTION
    spec_config = config  # (Predicted Outputs: the plain engine, its calls bringing predictions)
    if not predicted:
        spec_config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, speculative_config=args.spec)
        )
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    hello = [{"role": "user", "content": "Say hello."}]  # no kind's conversation: nothing cached for the runs

    def fresh(speculating: bool, structured: StructuredOutput | None) -> LLM:
        llm = LLM.from_config(spec_config if speculating else config, loaded)
        llm.chat(hello, warm)  # the first steps' allocations and kernels' first calls
        if structured is not None:  # the kind's grammar, compiled (one token: nothing a proposer could draft from)
            llm.chat(hello, dataclasses.replace(warm, max_tokens=1, structured=structured))
        return llm

    figures = [
        measure(fresh, kind, args.num_conversations, args.max_tokens, args.rounds, args.concurrency, predicted)
        for kind in kinds
    ]
    print(
        f"{args.num_conversations} conversations per kind, greedy, {args.max_tokens} tokens at most, "
        f"{args.concurrency} at a time; medians of {args.rounds} runs each on fresh engines, taking turns; "
        f"spec: {args.spec}"
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
        "spec": args.spec if predicted else json.loads(args.spec),
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
        "--spec",
        default=json.dumps(DEFAULT_SPEC),
        help=f"the speculating engine's --speculative-config, or {PREDICTION!r}: a plain engine whose edit calls "
        "bring their file as OpenAI's prediction (Predicted Outputs)",
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kinds of call, comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--num-conversations", type=positive_int, default=4, help="conversations per kind")
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed runs per engine, taking turns; figures are medians"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="conversations run at once (1: one after another)")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
