"""``boundless bench window``: a sliding-window model giving back the blocks past its window, against the same model
keeping every block, in the same KV pool.

Both engines attend within the window (the same outputs); they differ in what a request holds. The compared one gives
a request's blocks that have left every layer's window back to the pool when it runs short
(``KVCacheManager.release_outside_window``); the baseline keeps them until the request ends, as the engine did
before, so its context is capped by the pool too. The figures:

- **a batch larger than the baseline's pool**: ``--num-prompts`` random prompts of ``--input-len`` tokens, each
  answered greedily with ``--output-len`` tokens, all at once: output tokens per second of each engine and their ratio,
  the most requests either ran at once, its preemptions, and whether the answers are the same;
- **one context longer than the pool** (``--long-len`` tokens of prompt): the compared engine's seconds for it; the
  baseline's context stops at its pool, so it refuses the request.

The model is ``--model`` (a Hugging Face directory whose every layer slides), or by default a random Mistral-shaped
one written to a temporary directory (``--window``, ``--layers``, ``--hidden-size``): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from boundless.bench.kv_dtype import run_batch
from boundless.bench.offline import make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import positive_int
from boundless.engine.builder import released_window
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model


@dataclass
class BatchFigures:
    """One engine's run of the batch."""

    engine: str
    output_tokens_per_s: float
    seconds: float
    most_running: int
    preemptions: int
    blocks_released: int


def _model(args: argparse.Namespace, workdir: str) -> LoadedModel:
    if args.model is not None:
        loaded = load_model(args.model)
        if released_window(loaded.arch) is None:
            raise SystemExit(f"--model {args.model}: not every layer has a sliding window; nothing would be given back")
        return loaded
    spec = TinySpec(
        kind="mistral",
        vocab_size=512,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=2,
        max_position_embeddings=max(8192, args.long_len + args.output_len),
        sliding_window=args.window,
    )
    return load_model(str(write_random_model(f"{workdir}/model", spec)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir:
        loaded = _model(args, workdir)
        window = released_window(loaded.arch)
        assert window is not None
        config = engine_config(
            str(loaded.path), num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=None,
        )  # fmt: skip
        pool = args.num_kv_blocks * args.block_size
        if args.input_len + args.output_len > pool:
            raise SystemExit(f"--input-len plus --output-len must fit the baseline's pool ({pool} tokens)")
        prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
        batches, answers = [], []
        for name in ("every block kept", "blocks past the window given back"):
            engine = EngineCore.from_model(loaded, config)
            if name == "every block kept":
                engine.kv.window = None  # (the engine before: a request holds its blocks to its end)
            run_batch(engine, prompts[:1], 2)  # first calls' allocations and kernels
            engine.reset_prefix_cache()
            seconds, most, outs = run_batch(engine, prompts, args.output_len)
            stats = engine.scheduler.stats
            batches.append(
                BatchFigures(
                    engine=name,
                    output_tokens_per_s=sum(map(len, outs)) / seconds,
                    seconds=seconds,
                    most_running=most,
                    preemptions=stats.num_preemptions,
                    blocks_released=stats.num_window_blocks_released,
                )
            )
            answers.append(outs)
            if name != "every block kept":
                long_prompt = make_prompts(loaded, 1, args.long_len, args.bench_seed + 1)
                engine.reset_prefix_cache()
                long_seconds, _, _ = run_batch(engine, long_prompt, args.output_len)
            engine.close()
    ratio = batches[1].output_tokens_per_s / batches[0].output_tokens_per_s
    same = sum(a == b for a, b in zip(*answers, strict=True)) / len(prompts)
    print(
        f"{args.model or 'random Mistral-shaped model'} (window {window}): {args.num_prompts} prompts x "
        f"{args.input_len} tokens, {args.output_len} out each, all at once, greedy; a pool of {pool} tokens for both"
    )
    print_table(
        ["engine", "output tok/s", "seconds", "most running", "preemptions", "blocks given back"],
        [
            [b.engine, f"{b.output_tokens_per_s:.1f}", f"{b.seconds:.2f}", b.most_running, b.preemptions,
             b.blocks_released]
            for b in batches
        ],
    )  # fmt: skip
    print(f"given back / kept: {ratio:.2f}x output tok/s; answers identical {same:.0%}")
    print(
        f"one prompt of {args.long_len} tokens ({args.long_len / pool:.1f} pools): {long_seconds:.2f} s with blocks "
        "given back; " + f"keeping every block, a context stops at the pool's {pool} tokens"
    )
    result = {
        "model": args.model,
        "window": window,
        "pool_tokens": pool,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batches": [asdict(b) for b in batches],
        "throughput_ratio": ratio,
        "same_answers": same,
        "long_len": args.long_len,
        "long_seconds": long_seconds,
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model whose every layer slides (default: a random one)")
    parser.add_argument("--window", type=positive_int, default=256, help="the random model's sliding window")
    parser.add_argument("--layers", type=positive_int, default=4, help="the random model's layers")
    parser.add_argument("--hidden-size", type=positive_int, default=256, help="the random model's hidden size")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="prompts answered at once")
    parser.add_argument("--input-len", type=positive_int, default=1024)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--long-len", type=positive_int, default=8000, help="the prompt longer than the pool")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=160, help="each engine's pool, in blocks")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
