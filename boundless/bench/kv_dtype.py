"""``boundless bench kv-dtype``: KV in fewer bits (``--kv-cache-dtype``) and weights in FP8 (``--quantization fp8``)
against the model as it is, side by side.

Two engines over the same weights and the same KV memory (``--kv-cache-gb``): the baseline holds KV in the model's
type and its weights unquantized; the compared one takes ``--kv-cache-dtype`` and ``--quantization`` as given:

- **capacity**: the blocks each pool holds, and the tokens;
- **a batch larger than the baseline's pool**: ``--num-prompts`` random prompts of ``--input-len`` tokens, each
  answered greedily with ``--output-len`` tokens, all at once: output tokens per second of each engine and their
  ratio, the most sequences either ran at once, and its preemptions (a pool that holds more runs more at once and
  evicts less);
- **what the rounding costs**: a text (the engine's own source, ``--text-tokens`` of it) scored by both (prompt
  log-probabilities): the mean negative log-likelihood of each, the mean change of a token's log-probability, and
  the share of positions where both predict the same next token; and of the batch's greedy answers, the share
  identical and the mean tokens before the first difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from boundless.bench.offline import make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import EngineConfig, engine_config_from_flags, positive_int, refuse_engine_flags
from boundless.engine import core as engine_core
from boundless.engine.core import EngineCore
from boundless.engine.logprobs import SampledToken
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel, load_configured_model


@dataclass
class BatchFigures:
    """One engine's run of the batch."""

    engine: str  # what it holds in fewer bits (label)
    num_blocks: int
    pool_tokens: int
    output_tokens_per_s: float
    seconds: float
    most_running: int
    preemptions: int


@dataclass
class RoundingFigures:
    """The compared cache's scores and answers against the baseline's."""

    text_tokens: int
    baseline_nll: float
    compared_nll: float
    mean_logprob_change: float
    same_top_token: float
    same_answers: float
    tokens_before_first_difference: float


def run_batch(engine: EngineCore, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[int]]]:
    """Seconds to answer every prompt at once, the most requests running in one step, and the answers."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    answers: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    most = 0
    while engine.has_unfinished():
        for delta in engine.step():
            answers.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        most = max(most, len(engine.scheduler.running))
    return time.perf_counter() - start, most, [answers[f"b{i}"] for i in range(len(prompts))]


@dataclass(frozen=True)
class _Score:
    logprob: float  # of the text's token after those before it
    top: int  # the most likely token there


def _scores(engine: EngineCore, text: list[int]) -> list[_Score]:
    """Each text token's log-probability after the tokens before it (the first has none), and the likeliest token."""
    engine.add_request("text", text, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    scores: list[_Score] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.prompt_logprobs is not None:
                scores = [_score(s) for s in delta.prompt_logprobs[1:] if s is not None]
    return scores


def _score(s: SampledToken) -> _Score:
    assert s.logprob is not None  # (prompt log-probabilities always carry theirs)
    return _Score(s.logprob, s.top_logprobs[0][0] if s.top_logprobs else s.token_id)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def label(config: EngineConfig, loaded: LoadedModel) -> str:
    """What an engine holds in fewer bits: its KV's type, and its weights' quantization."""
    kv = config.cache.kv_cache_dtype
    text = f"KV {kv if kv != 'auto' else str(loaded.dtype).removeprefix('torch.')}"
    return text + (f", weights {config.model.quantization}" if config.model.quantization else "")


def source_text(loaded: LoadedModel, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens of the engine's own source (always installed with it): text with words and code."""
    tokens = loaded.tokenizer.encode(Path(engine_core.__file__).read_text())
    return tokens[:num_tokens]


def run(args: argparse.Namespace) -> dict[str, Any]:
    refuse_engine_flags(args, "bench kv-dtype", {"num_kv_blocks": "each pool is --kv-cache-gb of memory"})
    config = engine_config_from_flags(args)
    if config.cache.kv_cache_dtype == "auto" and config.model.quantization is None:
        raise SystemExit(
            "--kv-cache-dtype: name the type to compare with the model's own (fp8, fp8_e5m2, bfloat16), or give "
            "--quantization fp8, or both"
        )
    baseline = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, quantization=None),
        cache=dataclasses.replace(config.cache, kv_cache_dtype="auto"),
    )
    loaded = load_configured_model(baseline.model)
    compared_model = loaded if config.model.quantization is None else load_configured_model(config.model)
    prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
    text = source_text(loaded, args.text_tokens)
    compared = label(config, loaded)

    def engine(model: LoadedModel, cfg: EngineConfig) -> EngineCore:
        made = EngineCore.from_model(model, cfg)
        run_batch(made, prompts[:1], 2)  # first calls' allocations and kernels
        made.reset_prefix_cache()
        return made

    batches, answers, scores = [], [], []
    for model, cfg in ((loaded, baseline), (compared_model, config)):
        eng = engine(model, cfg)
        seconds, most, outs = run_batch(eng, prompts, args.output_len)
        stats = eng.stats()
        batches.append(
            BatchFigures(
                engine=label(cfg, loaded),
                num_blocks=eng.layout.num_blocks,
                pool_tokens=eng.layout.num_blocks * eng.layout.block_size,
                output_tokens_per_s=sum(map(len, outs)) / seconds,
                seconds=seconds,
                most_running=most,
                preemptions=stats.num_preemptions,
            )
        )
        answers.append(outs)
        eng.reset_prefix_cache()
        scores.append(_scores(eng, text))
        eng.close()
    base, comp = scores
    n = min(len(base), len(comp))
    rounding = RoundingFigures(
        text_tokens=n,
        baseline_nll=-sum(s.logprob for s in base[:n]) / n,
        compared_nll=-sum(s.logprob for s in comp[:n]) / n,
        mean_logprob_change=sum(abs(a.logprob - b.logprob) for a, b in zip(base, comp, strict=False)) / n,
        same_top_token=sum(a.top == b.top for a, b in zip(base, comp, strict=False)) / n,
        same_answers=sum(a == b for a, b in zip(*answers, strict=True)) / len(prompts),
        tokens_before_first_difference=sum(_first_difference(a, b) for a, b in zip(*answers, strict=True))
        / len(prompts),
    )
    print(
        f"{config.model.model}: {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} out each, "
        f"all at once, greedy; the same KV memory for both"
    )
    print_table(
        ["engine", "blocks", "pool tokens", "output tok/s", "most running", "preemptions"],
        [
            [
                b.engine,
                b.num_blocks,
                b.pool_tokens,
                f"{b.output_tokens_per_s:.1f}",
                b.most_running,
                b.preemptions,
            ]
            for b in batches
        ],
    )
    ratio = batches[1].output_tokens_per_s / batches[0].output_tokens_per_s
    blocks = batches[1].num_blocks / batches[0].num_blocks
    print(f"{compared} / {batches[0].engine}: {ratio:.2f}x output tok/s, {blocks:.2f}x blocks")
    print(
        f"rounding, over {n} tokens of text: mean NLL {rounding.baseline_nll:.4f} -> {rounding.compared_nll:.4f}, "
        f"a token's log-probability moved {rounding.mean_logprob_change:.4f} on average, the same most likely "
        f"next token at {rounding.same_top_token:.1%} of positions; greedy answers identical "
        f"{rounding.same_answers:.0%}, {rounding.tokens_before_first_difference:.1f} tokens before the first "
        "difference on average"
    )
    result = {
        "model": config.model.model,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "quantization": config.model.quantization,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batches": [asdict(b) for b in batches],
        "throughput_ratio": ratio,
        "rounding": asdict(rounding),
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="prompts answered at once")
    parser.add_argument("--input-len", type=positive_int, default=256)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--text-tokens", type=positive_int, default=500, help="tokens of text both engines score")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
