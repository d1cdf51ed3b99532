"""``boundless bench tensor-parallel``: a model split over ``--tensor-parallel-size`` ranks against it on one device.

The same model and flags, one engine on one device and one split over the ranks, each run in turn (never both at
once: on a CPU the ranks share its cores): the time of a decode step of one request (its ``--output-len`` tokens
after a short prompt, less its first: the step's fixed costs, the ranks' sums among them), the output tokens per
second of ``--num-prompts`` random prompts of ``--input-len`` tokens answered at once, and whether the split engine's
greedy answers are the other's (its sums run in another order: a near tie may differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Any

from boundless.bench.offline import make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import EngineConfig, engine_config_from_flags, positive_int
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.tensor_parallel import load_with_ranks
from boundless.llm import LLM


@dataclass
class EngineFigures:
    """One engine's runs."""

    ranks: int
    decode_step_ms: float  # one request's decode steps, each
    output_tokens_per_s: float  # the batch's
    batch_seconds: float


def _decode_token_ms(llm: LLM, prompt: list[int], output_len: int) -> float:
    """One request's decode time a token: the steps after its first token (the prompt's prefill), timed as they run.

    Timed within one run, not as the difference of two runs' times (a noisy machine made that negative).
    """
    llm.engine.reset_prefix_cache()
    llm.engine.add_request(
        "decode-timing", prompt, SamplingParams(temperature=0.0, max_tokens=max(2, output_len), ignore_eos=True)
    )
    tokens, start = 0, None
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            if start is None and delta.new_token_ids:
                start = time.perf_counter()  # the first token is in: decode steps from here
                tokens = len(delta.new_token_ids) - 1
            else:
                tokens += len(delta.new_token_ids)
    if start is None:
        raise RuntimeError("bench tensor-parallel: the timed request gave no token")
    return 1000 * (time.perf_counter() - start) / max(1, tokens)


def _measure(config: EngineConfig, args: argparse.Namespace) -> tuple[EngineFigures, list[list[int]]]:
    loaded, ranks = load_with_ranks(config)
    llm = LLM.from_config(config, loaded, ranks)

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    try:
        prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
        greedy(prompts[:2], 4)  # first calls' allocations
        decode_ms = _decode_token_ms(llm, prompts[0][:8], args.output_len)
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        answers = greedy(prompts, args.output_len)
        batch = time.perf_counter() - start
    finally:
        llm.close()
    figures = EngineFigures(
        ranks=config.model.tensor_parallel_size,
        decode_step_ms=decode_ms,
        output_tokens_per_s=sum(map(len, answers)) / batch,
        batch_seconds=batch,
    )
    return figures, answers


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config_from_flags(args)
    if config.model.tensor_parallel_size == 1:
        raise SystemExit("--tensor-parallel-size: name the ranks to compare with one device (2 or more)")
    one = dataclasses.replace(config, model=dataclasses.replace(config.model, tensor_parallel_size=1))
    baseline, base_answers = _measure(one, args)
    split, answers = _measure(config, args)
    same = sum(a == b for a, b in zip(base_answers, answers, strict=True))
    rows = [
        [f"{f.ranks} rank{'s' if f.ranks > 1 else ''}", f"{f.decode_step_ms:.1f}", f"{f.output_tokens_per_s:.1f}"]
        for f in (baseline, split)
    ]
    print_table(["engine", "decode step ms (1 request)", f"output tok/s ({args.num_prompts} requests)"], rows)
    print(
        f"ratio ({split.ranks} ranks / 1): decode step {split.decode_step_ms / baseline.decode_step_ms:.2f}x the time, "
        f"throughput {split.output_tokens_per_s / baseline.output_tokens_per_s:.2f}x; greedy answers identical for "
        f"{same}/{len(answers)} prompts"
    )
    result = {
        "model": config.model.model,
        "device": config.model.device,
        "dtype": config.model.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "engines": [asdict(baseline), asdict(split)],
        "same_answers": same,
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="prompts answered at once")
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
