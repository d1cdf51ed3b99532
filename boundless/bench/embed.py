"""``boundless bench embed``: transformers' base model and Boundless embedding the same prompts, side by side.

``--num-prompts`` random prompts of exactly ``--input-len`` token ids (equal lengths: transformers needs no padding
and no mask), embedded by transformers (the checkpoint's base model, ``sdpa`` attention, in batches of
``--hf-batch-size``: its last token's hidden state, or the mean of every token's, as the model's directory says) and
by ``LLM.embed`` (the engine's batches and chunks), taking turns ``--repeats`` times; figures are the medians. It
prints each system's prompts and tokens per second, the ratio, and how far apart the two systems' embeddings are (the
largest absolute difference, the smallest cosine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from boundless.bench.offline import load_hf_reference, make_prompts
from boundless.bench.report import output_path, print_table, write_json
from boundless.config import engine_config_from_flags, positive_int
from boundless.llm import LLM
from boundless.model.loader import load_configured_model
from boundless.model.pooling import EmbeddingPooling


def run(args: argparse.Namespace) -> dict:
    config = engine_config_from_flags(args)
    loaded = load_configured_model(config.model)
    prompts = make_prompts(loaded, args.num_prompts, args.input_len, args.bench_seed)
    llm = LLM.from_config(config, loaded)
    base = load_hf_reference(loaded).model  # (the causal LM's base model: its last hidden states, after the norm)
    seconds: dict[str, list[float]] = {"transformers": [], "boundless": []}
    vectors: dict[str, torch.Tensor] = {}
    try:
        for _ in range(args.repeats):
            start = time.perf_counter()
            vectors["transformers"] = _transformers(base, prompts, args.hf_batch_size, loaded.pooling, loaded.device)
            seconds["transformers"].append(time.perf_counter() - start)
            start = time.perf_counter()
            vectors["boundless"] = torch.tensor([out.outputs.embedding for out in llm.embed(prompts)])
            seconds["boundless"].append(time.perf_counter() - start)
    finally:
        llm.close()
    tokens = len(prompts) * args.input_len
    median = {name: statistics.median(times) for name, times in seconds.items()}
    rows = [[name, f"{len(prompts) / s:.1f}", f"{tokens / s:.0f}", f"{s:.2f}"] for name, s in median.items()]
    print_table(["system", "prompts/s", "tokens/s", "seconds"], rows)
    ratio = median["transformers"] / median["boundless"]
    difference = (vectors["boundless"] - vectors["transformers"]).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(vectors["boundless"], vectors["transformers"], dim=-1).min().item()
    print(
        f"boundless / transformers: {ratio:.2f}x the prompts per second; embeddings apart by at most {difference:.2e} "
        f"(smallest cosine {cosine:.6f})",
        flush=True,
    )
    result = {
        "model": config.model.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "seconds": seconds,
        "tokens_per_s": {name: tokens / s for name, s in median.items()},
        "speedup": ratio,
        "max_abs_difference": difference,
        "min_cosine": cosine,
    }
    if args.json:
        write_json(args.json, result)
    return result


@torch.inference_mode()
def _transformers(
    base: torch.nn.Module, prompts: list[list[int]], batch_size: int, pooling: EmbeddingPooling, device: torch.device
) -> torch.Tensor:
    """Each prompt's embedding from transformers' base model, ``batch_size`` prompts a forward pass."""
    out = []
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i : i + batch_size], device=device)
        states = base(input_ids=ids).last_hidden_state.float()
        pooled = states.mean(dim=1) if pooling.kind == "mean" else states[:, -1]  # (equal lengths: no padding)
        out.append(torch.tensor(pooling.embeddings(pooled.cpu().tolist())))
    return torch.cat(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--hf-batch-size", type=positive_int, default=16, help="prompts per transformers forward pass")
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed runs per system, taking turns")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
